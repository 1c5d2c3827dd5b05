"""The per-rank half of `make gpu-check` (scripts/gpu_check.py starts it under torchrun).

    torchrun --nproc_per_node=N scripts/gpu_check_worker.py nccl OUT       # one rank per GPU
    torchrun --nproc_per_node=2 scripts/gpu_check_worker.py gloo-cuda OUT  # 2 ranks on cuda:0

Each check returns (ok, detail), ok None for a SKIP with its reason; rank 0 writes
{check: [ok, detail]} to OUT/worker_<mode>.json. Every rank runs every check in the same order
(they are collectives); one that raises is a FAIL with its error, and the next check still runs.
Every check is listed in every mode, so the console says what each mode could not prove
(`skip_reason`). The verdicts are gpu_check.py's pure functions.
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

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import gpu_check as verdicts  # noqa: E402 - this folder is on sys.path (the script's own)

import minddp  # noqa: E402
from minddp import _compat  # noqa: E402
from minddp.engine import transfer  # noqa: E402
from minddp.parallel.dist import exit_worker  # noqa: E402

WIDTH, DEPTH, BATCH = 2048, 8, 4096  # ~34M parameters: several 25 MiB buckets, real backward kernels
KINDS = ("ddp", "optimizer_overlap", "fp16", "bf16", "zero1")
# the sync checks last: the gpu trace they switch on stays on, and calls Python on every allocation
NAMES = [*(f"equivalence {k}" for k in KINDS), "overlap", "comm stats", "memory flat 200 steps",
         "flight recorder", "find_unused_parameters", "join",
         *(f"no host sync {k}" for k in ("ddp", "zero1", "optimizer_overlap"))]
WORLD1 = ("world 1: the all-reduce is a no-op, so it proves nothing here; "
          "the 2-rank proof is the gloo-cuda worker's")


def skip_reason(name: str, mode: str, world: int) -> str | None:
    """Why `name` proves nothing in this mode and world (a SKIP), or None (it runs). Pure."""
    if mode == "nccl":
        if world < 2 and (name.startswith("equivalence") or name in ("find_unused_parameters", "join")):
            return WORLD1
        if world < 2 and name in ("overlap", "comm stats"):
            return "world 1: no collective kernel; needs 2 GPUs"
        return None
    if name == "comm stats":
        return None  # gloo futures carry no CUDA event: the timings must still be sane
    if name.startswith("no host sync"):
        return "gloo copies CUDA tensors through host memory: a host sync by design"
    if name == "equivalence zero1":
        return "gloo's reduce-scatter is CPU-only; ZeRO-1 is checked on nccl"
    if name in ("overlap", "memory flat 200 steps", "flight recorder"):
        return "an nccl item (collective kernels, the caching allocator under NCCL, NCCL's recorder)"
    return None


def model(device, width=WIDTH, depth=DEPTH) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*layers).to(device)


def data(device, step=0, width=WIDTH):
    g = torch.Generator(device=device).manual_seed(100 * step + dist.get_rank())
    return torch.randn(BATCH, width, device=device, generator=g)


def loss_of(net, x):
    return net(x).float().square().mean()


def wrap(kind: str, net, lr: float = 1e-4, **options):
    """(engine, optimizer) for: ddp, zero1, optimizer_overlap, fp16, bf16."""
    if kind == "zero1":
        ddp = minddp.DDP(net, shard_optimizer=True, **options)
        return ddp, minddp.ShardedOptimizer(ddp, torch.optim.AdamW, lr=lr)
    if kind == "optimizer_overlap":
        ddp = minddp.DDP(net, optimizer_overlap=True, **options)
        return ddp, minddp.OverlappedOptimizer(ddp, torch.optim.AdamW, lr=lr)
    ddp = minddp.DDP(net, compress=kind if kind in ("fp16", "bf16") else None, **options)
    return ddp, minddp.ReplicatedOptimizer(ddp, torch.optim.AdamW, lr=lr)


def step(ddp, opt, x) -> None:
    loss_of(ddp, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- checks
class SyncWatch:
    """Event, stream and device synchronisations whose Python stack passes through minddp's package, from
    torch.cuda._gpu_trace's callbacks (what set_sync_debug_mode does not flag: cudaEventSynchronize).
    The check script's own instrument: minddp itself never patches torch."""

    def __init__(self):
        self.calls: list[str] = []
        self.on = False
        from torch.cuda import _gpu_trace as trace

        torch._C._activate_gpu_trace()  # the CUDA sanitizer's switch: syncs call the callbacks below
        trace.register_callback_for_event_synchronization(lambda e: self._seen("event"))
        trace.register_callback_for_stream_synchronization(lambda s: self._seen("stream"))
        trace.register_callback_for_device_synchronization(lambda: self._seen("device"))

    def _seen(self, kind: str) -> None:
        if self.on:
            where = minddp_frame(sys._getframe(1))
            if where:
                self.calls.append(f"{kind} sync at {where}")


# minddp's code is what lies in the package's own folder: a path that merely contains "/minddp/"
# (a clone named minddp, its .venv with torch, its tests/) is not
PACKAGE = os.path.join(os.path.dirname(os.path.abspath(minddp.__file__)), "")


def minddp_frame(frame) -> str | None:
    """The innermost frame in minddp's package, as 'engine/file.py:line', or None."""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(PACKAGE):
            return f"{path[len(PACKAGE):]}:{frame.f_lineno}"
        frame = frame.f_back
    return None


WATCH: SyncWatch | None = None


def check_no_host_sync(device, kind: str):
    """Two steady steps under set_sync_debug_mode("error") (memcpy/item syncs raise) and the
    SyncWatch (event/stream/device syncs from minddp). The watch proves it sees first: a
    minddp HostCopy read, which waits on its event, must be caught."""
    global WATCH
    WATCH = WATCH or SyncWatch()
    WATCH.on, WATCH.calls = True, []
    transfer.to_host(torch.ones(4, device=device)).tolist()  # a sync minddp makes on purpose
    seen, WATCH.calls = WATCH.calls, []
    if not any("transfer.py" in c for c in seen):
        WATCH.on = False
        return False, f"the watch missed minddp's own event sync (saw {seen}): it would miss others"
    ddp, opt = wrap(kind, model(device))
    for i in range(3):  # the first iteration rebuilds the buckets (one plan broadcast)
        step(ddp, opt, data(device, i))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3, 5):  # the second steady step's forward reads the first's usage flags
            step(ddp, opt, data(device, i))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        WATCH.on = False
    torch.cuda.synchronize()
    calls = sorted(set(WATCH.calls))
    return not calls, f"{kind}: 2 steady steps, " + (f"host syncs: {calls}" if calls else "no host sync")


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


def profiled_backward(device, overlap: bool):
    """One profiled steady backward: (collective kernel intervals, other kernel intervals, engine)."""
    from torch.profiler import ProfilerActivity, profile

    ddp, opt = wrap("ddp", model(device), overlap=overlap)
    for i in range(3):
        step(ddp, opt, data(device, i))
    x = data(device, 3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss_of(ddp, x).backward()
        torch.cuda.synchronize()
    kernels = [(e.name.lower(), e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    comm = [(a, z) for n, a, z in kernels if "nccl" in n]
    compute = [(a, z) for n, a, z in kernels if "nccl" not in n and "memcpy" not in n and "memset" not in n]
    return comm, compute, ddp


def check_overlap(device, world: int):
    """Collective kernels beside backward kernels with overlap=True; the overlap=False control must
    show them serialised, or the measurement itself proves nothing."""
    comm, compute, _ = profiled_backward(device, overlap=True)
    serial_comm, serial_compute, _ = profiled_backward(device, overlap=False)
    overlapped = verdicts.concurrent_fraction(comm, compute)
    serial = verdicts.concurrent_fraction(serial_comm, serial_compute)
    ok, detail = verdicts.overlap_verdict(world, overlapped, serial, len(comm))
    return ok, f"{len(comm)} collective kernels; {detail}"


def check_comm_stats(device, world: int, mode: str):
    """CommStats' times: on nccl against the profiler's collective kernels; on gloo (no CUDA event
    on its futures) finite, positive and inside their span."""
    if mode != "nccl":
        ddp, opt = wrap("ddp", model(device, width=1024, depth=4))
        for i in range(3):
            step(ddp, opt, data(device, i, width=1024)[:1024])
        s = ddp.comm_stats
        return verdicts.stats_sane_verdict(s.busy_s, s.comm_time_s, s.exposed_wait_s)
    comm, _, ddp = profiled_backward(device, overlap=True)
    stats = ddp.comm_stats
    ok, detail = verdicts.comm_stats_verdict(world, stats.busy_s, verdicts.union_length(comm) / 1e6,
                                             stats.num_buckets)
    return ok, f"{detail}; {stats.launched_in_backward}/{stats.num_buckets} buckets launched in backward"


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
    """(name, check) for every name in NAMES: a SKIP with its reason where it proves nothing."""
    runs = {"overlap": lambda: check_overlap(device, world),
            "comm stats": lambda: check_comm_stats(device, world, mode),
            "memory flat 200 steps": lambda: check_memory_flat(device),
            "flight recorder": lambda: check_flight_recorder(device),
            "find_unused_parameters": lambda: check_find_unused(device), "join": lambda: check_join(device)}
    for kind in KINDS:
        runs[f"equivalence {kind}"] = lambda kind=kind: check_equivalence(device, kind)
        runs[f"no host sync {kind}"] = lambda kind=kind: check_no_host_sync(device, kind)
    for name in NAMES:
        reason = skip_reason(name, mode, world)
        yield name, (lambda reason=reason: (None, reason)) if reason else runs[name]


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
        print(f"rank {dist.get_rank()} {name} ...", flush=True)
        try:
            ok, detail = check()
        except Exception as e:  # noqa: BLE001 - a FAIL with its reason; the next check still runs
            ok, detail = False, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        flags = torch.tensor([0.0 if ok is None else 1.0 if ok is False else 0.5], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # FAIL if any rank failed
        results[name] = [None if ok is None else bool(flags.item() < 1), detail]
        print(f"rank {dist.get_rank()} {name}: {results[name][0]} {detail}", flush=True)
    if dist.get_rank() == 0:
        (out / f"worker_{mode}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    exit_worker(0)  # the trainer's guard: no teardown abort (-6) with the flight recorder on


if __name__ == "__main__":
    main()
