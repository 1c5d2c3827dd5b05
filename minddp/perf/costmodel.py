"""The alpha-beta cost model of collectives, and what it says about a DDP step.

Units, everywhere: sizes in bytes, times in seconds, alpha (per-message latency)
in seconds, beta (link bandwidth) in bytes per second. GB = 1e9 bytes, MB = 1e6
(MiB = 2**20). For n ranks and M bytes:

    ring all-reduce          2(n-1) a + 2(n-1)/n * M/b
    reduce-scatter, all-gather (n-1) a +  (n-1)/n * M/b
    all-to-all                 (n-1) a +  (n-1)/n * M/b
    broadcast, reduce     ceil(log2 n) a +          M/b   (pipelined tree)
    tree all-reduce       2 ceil(log2 n) a + 2 M/b         (reduce then broadcast, pipelined)
    tree all-reduce, whole messages  2 ceil(log2 n) (a + M/b)   (minddp.comm.collectives.tree_all_reduce)
    in-switch (NVLS, SHARP)   2 a +              M/b   (the switch reduces: half a ring's traffic)
    recursive doubling      ceil(log2 n) (a + M/b)

ZeRO-1 moves the same bytes as DDP's all-reduce (a reduce-scatter in backward, an all-gather
after the step) and keeps 1/dp of the optimizer states per rank:
    memory per rank = weights + gradients + optimizer states / dp

Buckets are the engine's own (minddp.engine.buckets.assign_buckets); memory per rank is
minddp.perf.memory's. From the command line: `minddp costmodel` (minddp/tools/costmodel.py).

    minddp costmodel allreduce --size 512MB --n 16 --alpha-us 5 --beta-gbs 50
    minddp costmodel ddp --params 124M --dtype bf16 --world 16 --preset ib-ndr --compute-ms 300
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..engine.buckets import TensorSpec, assign_buckets
from .jobs import ROOT
from .memory import memory_per_rank  # noqa: F401  (the memory model: one, in perf/memory.py)


def ring_all_reduce_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def reduce_scatter_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    return 0.0 if n <= 1 else (n - 1) * alpha + (n - 1) / n * nbytes / beta


all_gather_time = reduce_scatter_time
all_to_all_time = reduce_scatter_time


def broadcast_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    return 0.0 if n <= 1 else math.ceil(math.log2(n)) * alpha + nbytes / beta


reduce_time = broadcast_time


def tree_all_reduce_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    return 0.0 if n <= 1 else 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / beta


def unpipelined_tree_all_reduce_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Reduce up a binary tree, then broadcast down, whole messages per hop (no pipelining)."""
    return 0.0 if n <= 1 else 2 * math.ceil(math.log2(n)) * (alpha + nbytes / beta)


def in_switch_all_reduce_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """NVLink SHARP (NVLS) / InfiniBand SHARP: each rank sends M up once and receives the
    reduced M once; the switch does the arithmetic. About half a ring's bus traffic."""
    return 0.0 if n <= 1 else 2 * alpha + nbytes / beta


def tree_beats_ring_below(n: int, alpha: float, beta: float, pipelined: bool = False) -> float:
    """Message size (bytes) below which a tree all-reduce is faster than a ring: the ring's
    latency term grows with n, the tree's with log n, and the tree pays more per byte."""
    if n <= 2:
        return 0.0
    lg = math.ceil(math.log2(n))
    if pipelined:  # 2(n-1)a + 2(n-1)/n M/b  =  2 lg a + 2 M/b
        return max(0.0, (n - 1 - lg) * alpha * beta * n)
    # 2(n-1)a + 2(n-1)/n M/b  =  2 lg (a + M/b)
    slope = 2 * lg - 2 * (n - 1) / n
    return max(0.0, 2 * (n - 1 - lg) * alpha * beta / slope) if slope > 0 else float("inf")


def recursive_doubling_all_reduce_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    return 0.0 if n <= 1 else math.ceil(math.log2(n)) * (alpha + nbytes / beta)


def hierarchical_all_reduce_time(nbytes: float, nodes: int, per_node: int, intra_alpha: float,
                                 intra_beta: float, inter_alpha: float, inter_beta: float) -> float:
    """Reduce inside the node, ring all-reduce among node leaders, broadcast inside the node."""
    return (reduce_time(nbytes, per_node, intra_alpha, intra_beta)
            + ring_all_reduce_time(nbytes, nodes, inter_alpha, inter_beta)
            + broadcast_time(nbytes, per_node, intra_alpha, intra_beta))


# (latency coefficient, bandwidth coefficient) per op: t = ca*alpha + cb*M/beta
def coefficients(op: str, n: int) -> tuple[float, float]:
    lg = math.ceil(math.log2(n)) if n > 1 else 0
    return {
        "all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
        "ring_all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
        "rs_ag_all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
        "tree_all_reduce": (2 * lg, 2 * lg),
        "reduce_scatter": (n - 1, (n - 1) / n),
        "all_gather": (n - 1, (n - 1) / n),
        "zero1_reduce_scatter": (n - 1, (n - 1) / n),  # the same bytes, in place (n reduces on gloo)
        "zero1_all_gather": (n - 1, (n - 1) / n),
        "all_to_all": (n - 1, (n - 1) / n),
        "broadcast": (lg, 1.0),
        "reduce": (lg, 1.0),
    }[op]


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor, comparable to the link speed.
    Every all-reduce algorithm gets the all-reduce's factor, as in nccl-tests, so algorithms
    compare on one scale."""
    op = "all_reduce" if op.endswith("all_reduce") else op
    return coefficients(op, n)[1] if n > 1 else 1.0


@dataclass(frozen=True)
class Fabric:
    alpha: float  # s
    beta: float  # bytes/s, per direction
    note: str


# Documented link rates (per direction); alpha is a typical NCCL small-message latency.
PRESETS = {
    "h100-nvlink": Fabric(3e-6, 450e9, "H100 SXM NVLink4/NVSwitch: 900 GB/s bidirectional per GPU"),
    "pcie-gen5": Fabric(5e-6, 64e9, "PCIe Gen5 x16: 64 GB/s per direction"),
    "ib-hdr": Fabric(6e-6, 25e9, "InfiniBand HDR 200 Gb/s per port"),
    "ib-ndr": Fabric(5e-6, 50e9, "InfiniBand NDR 400 Gb/s per port"),
    "ib-xdr": Fabric(5e-6, 100e9, "InfiniBand XDR 800 Gb/s per port"),
    # NVIDIA Blackwell / GB200 data sheets: NVLink 5 is 1.8 TB/s bidirectional per GPU
    "b200-nvlink5": Fabric(3e-6, 900e9, "B200 NVLink 5 (NVSwitch): 1.8 TB/s bidirectional per GPU"),
    # GB200 NVL72: 72 GPUs in one NVLink domain, the same 1.8 TB/s per GPU to the switch tray
    "nvl72": Fabric(3e-6, 900e9, "GB200 NVL72: one NVLink 5 domain of 72 GPUs, 1.8 TB/s per GPU"),
    # fitted by `minddp bench` (2 gloo ranks on this 2-core VM, all_reduce 8 B-64 MiB)
    "this-machine-gloo": Fabric(300e-6, 1.4e9, "gloo over loopback, 2 ranks on 2 cores (measured)"),
}

@dataclass(frozen=True)
class Calibration:
    """What a DDP step costs on a measured machine, beyond alpha and beta (`make calibrate`)."""

    fabric: Fabric
    overhead_per_bucket_s: float = 0.0  # the engine's launch + hooks + wait, per bucket
    contention: float = 1.0  # all-reduce slowdown while the same cores compute (>= 1)
    # completion floor: a bucket that finishes under backward counts as in flight until the
    # engine notices (a callback that needs the GIL backward holds), measured at world 1
    floor_per_bucket_s: float = 0.0
    # alpha and beta fitted per collective where measured (gloo's reduce-scatter is not half
    # its all-reduce); `fabric` (the all-reduce's) for the others
    ops: tuple = ()  # ((op, Fabric), ...)
    # how much slower a collective progresses while backward runs on the same cores, fitted
    # from the engine itself (calibrate.under_backward_fit): where present, buckets are simulated
    # (in order, slowed until backward ends) instead of contention and floor per bucket
    under_backward: tuple = ()  # ((op, (slowdown, delay_s)), ...)
    backward_share: float = 2 / 3  # backward's share of forward + backward (measured with the above)

    def fabric_for(self, op: str) -> Fabric:
        return dict(self.ops).get(op, self.fabric)

    def slowdown_for(self, op: str) -> tuple[float, float] | None:
        """(slowdown, delay_s) of `op` under backward, where fitted."""
        return dict(self.under_backward).get(op)

    @classmethod
    def load(cls, path) -> "Calibration":
        import json

        with open(path) as f:
            c = json.load(f)
        note = f"measured by minddp calibrate ({path})"
        ops = tuple((op, Fabric(v["alpha"], v["beta"], note)) for op, v in c.get("ops", {}).items())
        fits = c.get("under_backward", {})
        under = tuple((op, (v["slowdown"], v.get("delay_s", 0.0))) for op, v in fits.items())
        share = fits.get("all_reduce", {}).get("backward_share", 2 / 3)
        floor = c.get("floor", {}).get("per_bucket_s", 0.0)
        return cls(Fabric(c["alpha"], c["beta"], note), c.get("overhead_per_bucket_s", 0.0),
                   c.get("contention", {}).get("factor", 1.0), floor, ops, under, share)


DEFAULT_CALIBRATION = ROOT / "docs" / "calibration.json"  # `make calibrate` writes it


def load_calibration(path=DEFAULT_CALIBRATION, preset: str = "this-machine-gloo") -> Calibration:
    """`make calibrate`'s file where there is one, else the preset."""
    return Calibration.load(path) if path and Path(path).exists() else Calibration(PRESETS[preset])


# the collective one bucket costs, per engine variant: DDP all-reduces; ZeRO-1 reduce-scatters
# in backward (its all-gather runs after the step, under the next forward)
BUCKET_OPS = {"all_reduce": ring_all_reduce_time, "reduce_scatter": reduce_scatter_time}


def predict_ddp_comm(bucket_bytes: list[float], world: int, cal: Calibration, backward_s: float = 0.0,
                     overlap: bool = True, op: str = "all_reduce") -> dict:
    """Busy time (at least one bucket in flight) and exposed time of one step's gradient
    reduction: one collective per bucket (`op`: a ring all-reduce, or ZeRO-1's reduce-scatter)
    plus the engine's per-bucket cost. With the calibration's under-backward slowdown the
    buckets are simulated (`simulate_buckets`); else a bucket launched under backward (every
    one but the last) is slowed by `contention` and held in flight by the completion floor.
    Exposed is what does not fit under backward, and at least the last bucket, which can only
    start when backward ends."""
    if world <= 1 or not bucket_bytes:
        return {"busy_s": 0.0, "exposed_s": 0.0, "buckets": len(bucket_bytes)}
    f, cost = cal.fabric_for(op), BUCKET_OPS[op]
    alone = [cost(b, world, f.alpha, f.beta) + cal.overhead_per_bucket_s for b in bucket_bytes]
    under = cal.slowdown_for(op)
    if under is not None and overlap:
        busy, end = simulate_buckets(bucket_bytes, alone, backward_s, *under)
        exposed = max(alone[-1], end - backward_s)
    else:
        # buckets launched under backward share the cores with it and wait to be noticed; the
        # last one is launched when backward ends (it holds the first layers' gradients) and
        # the end-of-backward wait notices it at once
        last = len(bucket_bytes) - 1
        per = [a + (cost(b, world, f.alpha, f.beta) * (cal.contention - 1) + cal.floor_per_bucket_s
                    if overlap and k < last else 0.0) for k, (b, a) in enumerate(zip(bucket_bytes, alone))]
        busy = sum(per)
        exposed = max(per[-1], busy - backward_s) if overlap else busy
    # communication under backward on shared cores takes its CPU from backward: of its busy
    # time, the fraction 1 - 1/contention is added to the step (0 with dedicated cores)
    # (the floor is waiting, not work: it steals nothing)
    shared = sum(cost(b, world, f.alpha, f.beta) * cal.contention + cal.overhead_per_bucket_s
                 for b in bucket_bytes[:-1]) if overlap else 0.0
    stolen = min(shared, backward_s) * (1 - 1 / cal.contention) if cal.contention > 1 else 0.0
    return {"busy_s": busy, "exposed_s": exposed, "stolen_s": stolen, "cost_s": exposed + stolen,
            "buckets": len(bucket_bytes)}


def predicted_comm(buckets, world: int, cal: Calibration, step_s: float, exposed_s: float, accum: int,
                   variant: str = "ddp") -> dict:
    """The model's busy and exposed time for a run's buckets (bytes, launch order). Backward: the
    synchronised micro-step's, from the step's compute (the step minus its exposed wait) split
    over the micro-steps, its share measured by `make calibrate` (2/3 without one). ZeRO-1
    reduce-scatters each bucket in backward (its all-gather is not in the engine's busy time);
    the optimizer overlap moves the same bytes as DDP. `alone_s`: the collectives as if nothing
    ran beside them (no contention, floor or slowdown)."""
    backward = (step_s - exposed_s) / accum * cal.backward_share
    op = "reduce_scatter" if variant == "zero1" else "all_reduce"
    full = predict_ddp_comm(list(buckets), world, cal, backward, op=op)
    alone = replace(cal, contention=1.0, floor_per_bucket_s=0.0, under_backward=())
    return {**full, "alone_s": predict_ddp_comm(list(buckets), world, alone, backward, op=op)["busy_s"]}


def simulate_buckets(bucket_bytes: list[float], alone_s: list[float], backward_s: float,
                     slowdown: float, delay_s: float = 0.0) -> tuple[float, float]:
    """(busy, last done) of one step's buckets. Bucket k is launched once backward has produced
    its share of the gradients (the last when backward ends); the process group runs them one
    after another; each needs `alone_s[k]` of work, done `slowdown` times slower while backward
    still runs on the same cores, at full speed after, and one that starts under backward
    waits `delay_s` first (its threads wait for a core). Busy is the union of [launch, done]."""
    total, ready, free, busy = sum(bucket_bytes), 0.0, 0.0, 0.0
    for k, (b, work) in enumerate(zip(bucket_bytes, alone_s)):
        ready += b
        launch = backward_s * ready / total if k < len(alone_s) - 1 else backward_s
        start = max(launch, free)
        begin = start + delay_s if start < backward_s else start
        slow = max(0.0, backward_s - begin) / slowdown  # the work that fits before backward ends
        done = begin + work * slowdown if work <= slow else max(begin, backward_s) + work - slow
        busy += done - start  # queued behind the bucket before: that part is already counted
        free = done
    return busy, free


def bucket_bytes(total: float, cap_mb: float | None, tensor_bytes: float | None = None) -> list[float]:
    """Bucket sizes for `total` bytes in fp32 tensors of about `tensor_bytes` each (100 tensors
    if not given), planned by the engine's own rule (minddp.engine.buckets.assign_buckets: MiB, a
    bucket closes once it reaches the cap, 1 MiB first when no cap is given)."""
    step = int(tensor_bytes or total / 100) // 4 * 4 or 4
    n, rest = divmod(int(total), step)
    numels = [step // 4] * n + ([max(1, rest // 4)] if rest >= 4 else [])
    cpu = torch.device("cpu")  # sizes only: a spec's device is never touched
    return planned_bytes([TensorSpec(k, torch.float32, cpu) for k in numels], cap_mb)


def planned_bytes(specs: list[TensorSpec], cap_mb: float | None,
                  order: list[int] | None = None) -> list[float]:
    """Each bucket's bytes, in launch order, as the engine plans these tensors (`order`: the
    order gradients become ready, default as given; the engine's first plan is reversed
    registration order): minddp.engine.buckets.assign_buckets itself, the one planner."""
    plan = assign_buckets(specs, list(range(len(specs))) if order is None else order, cap_mb)
    return [float(sum(specs[i].nbytes for i in ids)) for ids in plan]


DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp64": 8}


def ddp_comm_time(n_params: float, bytes_per_param: int, bucket_mb: float | None, world: int,
                  alpha: float, beta: float, tensor_bytes: float | None = None) -> dict:
    """Gradient all-reduce of one DDP step: one ring all-reduce per bucket, the buckets the
    engine would build (bucket_bytes)."""
    total = n_params * bytes_per_param
    sizes = bucket_bytes(total, bucket_mb, tensor_bytes)
    ca, cb = coefficients("all_reduce", world) if world > 1 else (0, 0)
    latency = len(sizes) * ca * alpha
    bandwidth = sum(cb * s / beta for s in sizes)
    return {"buckets": len(sizes), "bytes": sum(sizes), "latency_s": latency, "bandwidth_s": bandwidth,
            "total_s": latency + bandwidth,
            "last_bucket_s": ring_all_reduce_time(sizes[-1], world, alpha, beta)}


def zero1_comm_time(n_params: float, bytes_per_param: int, bucket_mb: float, world: int,
                    alpha: float, beta: float) -> dict:
    """ZeRO-1: a reduce-scatter per bucket in backward, an all-gather per bucket after the step.
    Together the bytes and messages of DDP's ring all-reduce, split in two phases."""
    ddp = ddp_comm_time(n_params, bytes_per_param, bucket_mb, world, alpha, beta)
    half = {k: ddp[k] / 2 for k in ("latency_s", "bandwidth_s", "total_s")}
    return {"buckets": ddp["buckets"], "bytes": ddp["bytes"], "reduce_scatter_s": half["total_s"],
            "all_gather_s": half["total_s"], "total_s": ddp["total_s"]}


def exposed_comm(comm: dict, backward_s: float, overlap: bool = True) -> float:
    """Communication not hidden under backward: with overlap, everything that does not fit
    under the backward pass, and at least the last bucket (it can only start at the end)."""
    if not overlap:
        return comm["total_s"]
    return max(comm["last_bucket_s"], comm["total_s"] - backward_s)


def best_bucket_mb(n_params, bytes_per_param, world, alpha, beta, backward_s,
                   candidates=(0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000),
                   calibration: Calibration | None = None, tensor_bytes: float | None = None
                   ) -> tuple[float, float]:
    """The candidate cap that adds the least to the step (exposed communication plus the compute
    time contention takes from backward), and that time. With a calibration every bucket also
    pays the engine's cost, and buckets under backward the contention factor: that is what
    makes small buckets lose on a machine whose communication shares the compute's cores."""
    cal = calibration or Calibration(Fabric(alpha, beta, "given"))
    total = n_params * bytes_per_param
    scored = [(predict_ddp_comm(bucket_bytes(total, c, tensor_bytes), world, cal, backward_s)["cost_s"], c)
              for c in candidates]
    exposed, cap = min(scored)
    return cap, exposed


def inter_node_bytes(nbytes: float, nodes: int, per_node: int) -> dict:
    """Bytes each inter-node link carries per direction for one all-reduce of M bytes.
    Flat ring over all n = nodes*per_node ranks: every link of the ring, the node-crossing
    ones included, carries 2(n-1)/n * M. Hierarchical: only the leaders cross nodes, in a
    ring all-reduce among `nodes` leaders: 2(nodes-1)/nodes * M (M when nodes = 2)."""
    n = nodes * per_node
    return {"flat_ring": 2 * (n - 1) / n * nbytes, "hierarchical": 2 * (nodes - 1) / nodes * nbytes}
