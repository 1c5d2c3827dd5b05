"""Overlap timeline: one training step per rank, as a Chrome/Perfetto trace and a PNG.

    torchrun --standalone --nproc_per_node=2 -m minddp.timeline --out docs/timeline

runs a GPT step with overlap on and with overlap off and draws, per rank, forward and
backward compute and every bucket's all-reduce from launch to completion, so you can see
how much communication hides under backward. Open the .json in https://ui.perfetto.dev
or chrome://tracing. The trainer writes the same for one step with `train.trace_step=N`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .cli import pyplot, start, sync
from .steptrace import StepTrace, gather  # noqa: F401 - re-exported for scripts


def chrome_trace(per_rank: list[dict], label: str = "") -> list[dict]:
    ev = []
    for rank, tr in enumerate(per_rank):
        for lane in ("compute", "comm"):
            for name, s, e in tr[lane]:
                ev.append({"name": name, "ph": "X", "pid": f"rank {rank}", "tid": f"{label}{lane}",
                           "ts": s * 1e6, "dur": max(e - s, 0) * 1e6})
    return ev


def render(traces: dict[str, list[dict]], png: str) -> None:
    """One panel per label (e.g. overlap on / off); per rank a compute and a comm lane."""
    plt = pyplot()

    colors = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#8172B2",
              "exposed wait": "#C44E52"}
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.6 + 1.3 * len(next(iter(traces.values())))
                                                            * len(traces)), squeeze=False)
    for ax, (label, per_rank) in zip(axes[:, 0], traces.items()):
        ticks, names = [], []
        for rank, tr in enumerate(per_rank):
            y = rank * 3
            for name, s, e in tr["compute"]:
                kind = name if name == "exposed wait" else name.split()[0]
                ax.barh(y + 1, (e - s) * 1e3, left=s * 1e3, height=0.8, color=colors.get(kind, "#999"),
                        edgecolor="white", linewidth=0.5)
            for i, (_name, s, e) in enumerate(tr["comm"]):
                ax.barh(y, (e - s) * 1e3, left=s * 1e3, height=0.8, color="#DD8452" if i % 2 else "#E6A157",
                        edgecolor="#805020", linewidth=0.5)
            ticks += [y, y + 1]
            names += [f"rank {rank} comm", f"rank {rank} compute"]
        ax.set_yticks(ticks, names)
        ax.set_title(label)
        ax.set_xlabel("ms since the step started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in list(colors.values()) + ["#DD8452"]]
    fig.legend(handles, list(colors) + ["bucket all-reduce"], loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write(traces: dict[str, list[dict]], out_prefix: str) -> tuple[str, str]:
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    events = [e for label, per_rank in traces.items() for e in chrome_trace(per_rank, f"{label}: ")]
    with open(out_prefix + ".json", "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    render(traces, out_prefix + ".png")
    return out_prefix + ".json", out_prefix + ".png"


def compiled(model, how: str):
    """`model`: one graph, so its backward is one node and every gradient hook fires at its
    end; `blocks`: one graph per transformer block, so hooks fire block by block."""
    if how == "model":
        return torch.compile(model)
    if how == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    return model


def main(argv=None) -> None:
    from torch.nn import functional as F

    from .ddp import DistributedDataParallel
    from .model import GPT, GPTConfig

    ap = argparse.ArgumentParser(prog="python -m minddp.timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/timeline")
    ap.add_argument("--bucket-mb", type=float, default=5.0)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--compile", default="none", choices=["none", "model", "blocks", "all"],
                    help="torch.compile the whole model, each transformer block, or compare all three "
                         "(overlap on)")
    args = ap.parse_args(argv)
    device = start().device
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.n_layer, n_head=6, n_embd=args.n_embd, block_size=128)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, 256, (4, cfg.block_size + 1), generator=g).to(device)
    traces = {}
    variants = ([(True, "none"), (False, "none")] if args.compile == "none" else
                [(True, c) for c in ("none", "model", "blocks")] if args.compile == "all" else
                [(True, args.compile)])
    for overlap, how in variants:
        model = DistributedDataParallel(compiled(GPT(cfg).to(device), how), bucket_cap_mb=args.bucket_mb,
                                        overlap=overlap)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        for _ in range(3):  # two warm-up steps (the first rebuilds the buckets), one traced
            tr = StepTrace(model)
            dist.barrier()
            tr.start()
            t = time.perf_counter()  # spans end after a CUDA sync: the work, not its launch
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            sync(device)
            tr.span("forward", t, t := time.perf_counter())
            loss.backward()
            sync(device)
            tr.span("backward", t, time.perf_counter())
            t = time.perf_counter()
            opt.step()
            opt.zero_grad()
            sync(device)
            tr.span("optimizer", t, time.perf_counter())
            trace = tr.stop()
        label = (f"overlap={overlap}, compile={how}: {len(model.bucket_assignment)} buckets, "
                 f"cap {args.bucket_mb:g} MB")
        traces[label] = gather(trace)
    if dist.get_rank() == 0:
        print("wrote", *write(traces, args.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
