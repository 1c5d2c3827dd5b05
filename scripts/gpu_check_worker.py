"""The per-rank half of `make gpu-check` (scripts/gpu_check.py starts it under torchrun).

    torchrun --nproc_per_node=N scripts/gpu_check_worker.py nccl OUT       # one rank per GPU
    torchrun --nproc_per_node=2 scripts/gpu_check_worker.py gloo-cuda OUT  # 2 ranks on cuda:0

Each check returns (ok, detail); rank 0 writes {check: [ok, detail]} to OUT/worker_<mode>.json.
Every rank runs every check in the same order (they are collectives); one that raises is a FAIL
with its error, and the next check still runs.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minddp  # noqa: E402
from minddp import _compat  # noqa: E402
from minddp.observer import _union_length  # noqa: E402 - the same union CommStats.busy_s uses

WIDTH, DEPTH, BATCH = 2048, 8, 4096  # ~34M parameters: several 25 MiB buckets, real backward kernels


def model(device, width=WIDTH, depth=DEPTH) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*layers).to(device)


def data(device, step=0, width=WIDTH):
    g = torch.Generator(device=device).manual_seed(100 * step + dist.get_rank())
    return torch.randn(BATCH, width, device=device, generator=g)


def loss_of(net, x):
    return net(x).float().square().mean()


def wrap(kind: str, net, lr: float = 1e-4):
    """(engine, optimizer) for: ddp, zero1, optimizer_overlap, fp16, bf16."""
    if kind == "zero1":
        ddp = minddp.DDP(net, shard_optimizer=True)
        return ddp, minddp.ShardedOptimizer(ddp, torch.optim.AdamW, lr=lr)
    if kind == "optimizer_overlap":
        ddp = minddp.DDP(net, optimizer_overlap=True)
        return ddp, minddp.OverlappedOptimizer(ddp, torch.optim.AdamW, lr=lr)
    ddp = minddp.DDP(net, compress=kind if kind in ("fp16", "bf16") else None)
    return ddp, minddp.ReplicatedOptimizer(ddp, torch.optim.AdamW, lr=lr)


def step(ddp, opt, x) -> None:
    loss_of(ddp, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- checks
def check_no_host_sync(device, kind: str):
    """A steady step under torch.cuda.set_sync_debug_mode("error"): any host sync raises."""
    ddp, opt = wrap(kind, model(device))
    for i in range(3):  # the first iteration rebuilds the buckets (one plan broadcast)
        step(ddp, opt, data(device, i))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3, 5):
            step(ddp, opt, data(device, i))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return True, f"{kind}: 2 steady steps, no host sync"


def _two_backwards(model, x):
    """The gradients of a second backward (the first rebuilds minddp's buckets); parameters
    unchanged in between (an overlapped optimizer steps inside backward: it runs with lr=0)."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss_of(model, x).backward()


def check_equivalence(device, kind: str):
    """minddp's gradients against torch DDP's (the same 16-bit hook for compression)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks

    x = data(device, 7)
    theirs = nn.parallel.DistributedDataParallel(model(device), device_ids=[device.index])
    hook = {"fp16": hooks.fp16_compress_hook, "bf16": hooks.bf16_compress_hook}.get(kind)
    if hook is not None:
        theirs.register_comm_hook(None, hook)
    _two_backwards(theirs, x)
    ref = [p.grad for p in theirs.module.parameters()]
    ddp, opt = wrap(kind, model(device), lr=0.0)
    _two_backwards(ddp, x)
    if kind == "zero1":  # each rank holds its shard of the averaged gradient: compare those
        opt.grad_norm()  # cuts this rank's segments in the final layout
        grads = [s.grad for s in opt._segments]
        refs = [ref[s.param].flatten()[s.lo:s.hi] for s in opt._segments]
    else:
        grads, refs = [p.grad for p in ddp.module.parameters()], ref
    err = max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, refs))
    scale = max(r.float().abs().max().item() for r in refs)
    tol = 1e-5 if kind not in ("fp16", "bf16") else 2e-2
    return err <= tol * max(scale, 1e-12), f"{kind}: max |grad - torch DDP| {err:.3g} (scale {scale:.3g})"


def check_overlap_and_stats(device, world: int):
    """A profiled steady step: collective kernels run while backward kernels run (world >= 2),
    and CommStats' CUDA-event busy time agrees with the profiler's collective kernels."""
    from torch.profiler import ProfilerActivity, profile

    ddp, opt = wrap("ddp", model(device))
    for i in range(3):
        step(ddp, opt, data(device, i))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss_of(ddp, data(device, 3)).backward()
        torch.cuda.synchronize()
    stats = ddp.comm_stats
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    comm = [(a, z) for n, a, z in kernels if "nccl" in n.lower()]
    compute = [(a, z) for n, a, z in kernels if "nccl" not in n.lower() and "memcpy" not in n.lower()]
    overlapped = sum(1 for a, z in comm if any(a < cz and ca < z for ca, cz in compute))
    kernel_busy = _union_length(comm) / 1e6
    consistent = stats.busy_s >= 0.8 * kernel_busy and (kernel_busy > 0 or world == 1)
    detail = (f"{len(comm)} collective kernels, {overlapped} concurrent with compute; busy_s "
              f"{stats.busy_s * 1e3:.2f} ms (events) vs collective kernels {kernel_busy * 1e3:.2f} ms "
              f"(profiler); {stats.launched_in_backward}/{stats.num_buckets} buckets launched in backward")
    ok = consistent and (overlapped > 0 if world >= 2 else True)
    return ok, detail


def check_memory_flat(device, steps: int = 200):
    """Allocated and reserved memory after step 20 equal those after the last step."""
    ddp, opt = wrap("ddp", model(device, width=1024, depth=4))
    marks = {}
    for i in range(steps):
        step(ddp, opt, data(device, i % 4, width=1024)[:1024])
        if i + 1 in (20, steps):
            torch.cuda.synchronize()
            marks[i + 1] = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
    (a0, r0), (a1, r1) = marks[20], marks[steps]
    ok = a1 - a0 <= 1 << 20 and r1 == r0
    mib = 2**20
    return ok, (f"allocated {a0 / mib:.1f} -> {a1 / mib:.1f} MiB, "
                f"reserved {r0 / mib:.1f} -> {r1 / mib:.1f} MiB")


def check_flight_recorder(device):
    """NCCL's own recorder holds the collectives just run (gloo's would be empty here)."""
    t = torch.ones(1024, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    raw = _compat.dump_flight_recorder(str(dist.get_backend()))
    entries = pickle.loads(raw).get("entries", [])
    return len(entries) >= 3, f"{len(entries)} entries in the dump ({len(raw)} bytes)"


def check_find_unused(device):
    """find_unused_parameters against torch DDP: a head used on rank 0 only."""
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 8), nn.Linear(64, 8)

        def forward(self, x, use_b):
            h = torch.tanh(self.body(x))
            return self.a(h) + (self.b(h) if use_b else 0)

    torch.manual_seed(0)
    base = TwoHeads().to(device)
    x = torch.randn(16, 64, device=device) + dist.get_rank()
    grads = []
    for m in (minddp.DDP(copy.deepcopy(base), find_unused_parameters=True),
              nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[device.index],
                                                  find_unused_parameters=True)):
        m(x, use_b=dist.get_rank() == 0).square().mean().backward()
        grads.append([p.grad for p in m.module.parameters()])
    err = max((a - b).abs().max().item() for a, b in zip(*grads))
    return err < 1e-6, f"max |grad - torch DDP| {err:.3g}"


def check_join(device):
    """Uneven inputs: rank r runs 3 + r steps inside join(); every rank ends with the same model."""
    ddp, opt = wrap("ddp", model(device, width=256, depth=2))
    with ddp.join():
        for i in range(3 + dist.get_rank()):
            step(ddp, opt, data(device, i, width=256)[:256])
    flat = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    same = all(torch.equal(everyone[0], e) for e in everyone)
    world = dist.get_world_size()
    return same, f"{world} ranks ran 3..{2 + world} steps; replicas equal: {same}"


def checks(mode: str, device, world: int):
    # gloo with CUDA tensors: the all-reduce paths (its reduce, ZeRO-1's, may be CPU-only)
    kinds = ["ddp", "optimizer_overlap", "fp16", "bf16"] + (["zero1"] if mode == "nccl" else [])
    for kind in kinds:
        yield f"equivalence {kind}", lambda kind=kind: check_equivalence(device, kind)
    if mode == "nccl":  # gloo copies CUDA tensors through host memory: a sync by design
        for kind in ("ddp", "zero1", "optimizer_overlap"):
            yield f"no host sync {kind}", lambda kind=kind: check_no_host_sync(device, kind)
        yield "overlap and comm stats", lambda: check_overlap_and_stats(device, world)
        yield "memory flat 200 steps", lambda: check_memory_flat(device)
        yield "flight recorder nccl", lambda: check_flight_recorder(device)
        if world >= 2:
            yield "find_unused_parameters", lambda: check_find_unused(device)
            yield "join", lambda: check_join(device)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    local = int(os.environ["LOCAL_RANK"])
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    if mode == "nccl":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # two ranks on one GPU: nccl refuses that, gloo moves CUDA tensors through the host
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("gloo")
    torch.backends.cuda.matmul.allow_tf32 = False  # exact comparisons against torch DDP
    results = {}
    for name, check in checks(mode, device, dist.get_world_size()):
        try:
            ok, detail = check()
        except Exception as e:  # noqa: BLE001 - a FAIL with its reason; the next check still runs
            ok, detail = False, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        flags = torch.tensor([0.0 if ok else 1.0], device=device)
        dist.all_reduce(flags)  # FAIL if any rank failed
        results[name] = [bool(flags.item() == 0), detail]
        print(f"rank {dist.get_rank()} {name}: {'ok' if ok else 'FAIL'} {detail}", flush=True)
    if dist.get_rank() == 0:
        (out / f"worker_{mode}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
