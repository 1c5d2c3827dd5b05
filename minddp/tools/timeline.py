"""Overlap timeline: one training step per rank, as a Chrome/Perfetto trace and a PNG.

    torchrun --standalone --nproc_per_node=2 -m minddp timeline [--out outputs/timeline/timeline]

runs a GPT step with overlap on and with overlap off and draws, per rank, forward and
backward compute and every bucket's all-reduce from launch to completion, so you can see
how much communication hides under backward. Open the .json in https://ui.perfetto.dev
or chrome://tracing. The trainer writes the same for one step with `train.trace_step=N`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.ddp import DistributedDataParallel
from ..model.gpt import GPT
from ..perf.clock import after_warmup
from ..perf.engine_bench import phases, step, step_then_next
from ..train.metrics.steptrace import StepTrace, chrome_trace, gather, render, write  # noqa: F401
from .arguments import positive_float, tool_parser, writable_out
from .cli import start
from .workload import add_gpt_size, bench_gpt, compiled, lm_loss, parse_gpt_size


def traced(model, spans_of) -> dict:
    """One step's trace: the phases `spans_of(start)` times on the device's clock (perf's
    engine_bench), every bucket's collective from the engine's observer."""
    tr = StepTrace(model)
    dist.barrier()
    for name, a, z in spans_of(tr.start):
        tr.span(name, a, z)
    return tr.stop()


def traced_step(model, opt, x) -> dict:
    """Forward, backward and optimizer of one step (perf's `phases`), gradients zeroed after."""
    trace = traced(model, lambda begin: phases(model, opt, x, begin))
    opt.zero_grad()
    return trace


def main(argv=None) -> None:
    ap = tool_parser("timeline", __doc__)
    ap.add_argument("--out", type=writable_out, default="outputs/timeline/timeline",
                    help="prefix of the .json and .png (make docs: docs/timeline)")
    ap.add_argument("--bucket-mb", type=positive_float, default=5.0)
    add_gpt_size(ap)
    ap.add_argument("--compile", default="none", choices=["none", "model", "blocks", "all"],
                    help="torch.compile the whole model, each transformer block, or compare all three "
                         "(overlap on); minddp has dynamo split a whole-model graph at its buckets")
    ap.add_argument("--compile-backend", default="aot_eager",
                    help="torch.compile's backend (inductor takes minutes to compile on a small CPU machine)")
    ap.add_argument("--zero1", action="store_true",
                    help="ZeRO-1 (shard_optimizer + ShardedOptimizer(AdamW)): the step's all-gathers "
                         "under the next forward and backward")
    args = parse_gpt_size(ap, argv)
    device = start().device
    torch.manual_seed(0)
    cfg = bench_gpt(args.n_layer, args.n_embd)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, 256, (4, cfg.block_size + 1), generator=g).to(device)
    if args.zero1:
        return zero1_timeline(args, GPT(cfg).to(device), x)
    traces = {}
    variants = ([(True, "none"), (False, "none")] if args.compile == "none" else
                [(True, c) for c in ("none", "model", "blocks")] if args.compile == "all" else
                [(True, args.compile)])
    for overlap, how in variants:
        gpt = compiled(GPT(cfg).to(device), how, args.compile_backend)
        model = DistributedDataParallel(gpt, bucket_cap_mb=args.bucket_mb,
                                        overlap=overlap)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        # two warm-up steps (the first rebuilds the buckets), then the traced one
        trace = after_warmup(lambda m=model, o=opt: traced_step(m, o, x), reps=1)[0]
        label = (f"overlap={overlap}, compile={how}: {len(model.bucket_assignment)} buckets, "
                 f"cap {args.bucket_mb:g} MB")
        traces[label] = gather(trace)
    if dist.get_rank() == 0:
        print("wrote", *write(traces, args.out))
    dist.barrier()  # leave together: a rank tearing its group down early can abort a peer's gloo
    dist.destroy_process_group()


def zero1_timeline(args, gpt, x) -> None:
    """One ZeRO-1 optimizer step and the forward and backward after it: each bucket's
    all-gather from its launch in the step to its completion, the waits it cost the forward
    (exposed all-gather), and the next backward's reduce-scatters."""
    from ..optim.zero import ShardedOptimizer

    model = DistributedDataParallel(gpt, bucket_cap_mb=args.bucket_mb, shard_optimizer=True)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=x.device.type in ("cpu", "cuda"))
    after_warmup(lambda: step(model, opt, x), reps=0)  # the bucket rebuild, the optimizer's states
    opt.zero_grad()
    lm_loss(model, x).backward()  # the gradients the traced optimizer step applies
    trace = traced(model, lambda begin: step_then_next(model, opt, x, begin))
    label = (f"ZeRO-1: optimizer step, then forward and backward; {len(model.bucket_assignment)} buckets, "
             f"cap {args.bucket_mb:g} MB")
    per_rank = gather({**trace, "exposed_gather_s": opt.gather_wait_s})  # the forward's waits
    if dist.get_rank() == 0:
        print("wrote", *write({label: per_rank}, args.out))
        print(zero1_summary(per_rank))
    dist.barrier()  # leave together: a rank tearing its group down early can abort a peer's gloo
    dist.destroy_process_group()


def zero1_summary(per_rank: list[dict]) -> str:
    """Per rank: how long the all-gathers ran, how much of it the forward waited for."""
    lines = []
    for rank, tr in enumerate(per_rank):
        spans = {n: (s, e) for n, s, e in tr["compute"]}
        gathers = [(s, e) for n, s, e in tr["comm"] if n.startswith("all-gather")]
        if not gathers:
            continue
        first, last = min(s for s, _ in gathers), max(e for _, e in gathers)
        fwd = spans.get("forward", (0.0, 0.0))
        lines.append(f"rank {rank}: all-gathers from {first * 1e3:.1f} to {last * 1e3:.1f} ms (the optimizer "
                     f"step ends at {spans['optimizer'][1] * 1e3:.1f} ms, the forward runs "
                     f"{fwd[0] * 1e3:.1f}-{fwd[1] * 1e3:.1f} ms); exposed all-gather "
                     f"{tr['exposed_gather_s'] * 1e3:.2f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
