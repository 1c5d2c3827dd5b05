"""The alpha-beta cost model of collectives, and what it says about a DDP step.

Units, everywhere: sizes in bytes, times in seconds, alpha (per-message latency)
in seconds, beta (link bandwidth) in bytes per second. GB = 1e9 bytes, MB = 1e6
(MiB = 2**20). For n ranks and M bytes:

    ring all-reduce          2(n-1) a + 2(n-1)/n * M/b
    reduce-scatter, all-gather (n-1) a +  (n-1)/n * M/b
    all-to-all                 (n-1) a +  (n-1)/n * M/b
    broadcast, reduce     ceil(log2 n) a +          M/b   (pipelined tree)
    tree all-reduce       2 ceil(log2 n) a + 2 M/b         (reduce then broadcast, pipelined)
    recursive doubling      ceil(log2 n) (a + M/b)

    python -m minddp.costmodel allreduce --size 512MB --n 16 --alpha-us 5 --beta-gbs 50
    python -m minddp.costmodel ddp --params 124M --dtype bf16 --world 16 --preset ib-ndr --compute-ms 300
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass


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
        "reduce_scatter": (n - 1, (n - 1) / n),
        "all_gather": (n - 1, (n - 1) / n),
        "all_to_all": (n - 1, (n - 1) / n),
        "broadcast": (lg, 1.0),
        "reduce": (lg, 1.0),
    }[op]


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor, comparable to the link speed."""
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
    # fitted by `python -m minddp.bench` (2 gloo ranks on this 2-core VM, all_reduce 8 B-64 MiB)
    "this-machine-gloo": Fabric(300e-6, 1.4e9, "gloo over loopback, 2 ranks on 2 cores (measured)"),
}

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp64": 8}


def ddp_comm_time(n_params: float, bytes_per_param: int, bucket_mb: float, world: int,
                  alpha: float, beta: float, first_bucket_mb: float = 1.0) -> dict:
    """Gradient all-reduce of one DDP step: one ring all-reduce per bucket."""
    total = n_params * bytes_per_param
    cap, first = bucket_mb * 1e6, min(first_bucket_mb, bucket_mb) * 1e6
    sizes = [min(first, total)]
    left = total - sizes[0]
    while left > 0:
        sizes.append(min(cap, left))
        left -= sizes[-1]
    ca, cb = coefficients("all_reduce", world) if world > 1 else (0, 0)
    latency = len(sizes) * ca * alpha
    bandwidth = sum(cb * s / beta for s in sizes)
    return {"buckets": len(sizes), "bytes": total, "latency_s": latency, "bandwidth_s": bandwidth,
            "total_s": latency + bandwidth,
            "last_bucket_s": ring_all_reduce_time(sizes[-1], world, alpha, beta)}


def exposed_comm(comm: dict, backward_s: float, overlap: bool = True) -> float:
    """Communication not hidden under backward: with overlap, everything that does not fit
    under the backward pass, and at least the last bucket (it can only start at the end)."""
    if not overlap:
        return comm["total_s"]
    return max(comm["last_bucket_s"], comm["total_s"] - backward_s)


def best_bucket_mb(n_params, bytes_per_param, world, alpha, beta, backward_s,
                   candidates=(0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000)) -> tuple[float, float]:
    """The candidate cap with the least exposed communication, and that exposed time."""
    scored = [(exposed_comm(ddp_comm_time(n_params, bytes_per_param, c, world, alpha, beta), backward_s), c)
              for c in candidates]
    exposed, cap = min(scored)
    return cap, exposed


# ------------------------------------------------------------------------ CLI
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "T": 1e12}


def parse_size(text: str) -> float:
    """'512MB' -> 5.12e8, '64MiB' -> 67108864, '124M' -> 1.24e8 (also for parameter counts)."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 64MiB, 124M)")
    return float(m.group(1)) * _UNITS[m.group(2).upper()]


def _fabric(args) -> Fabric:
    if args.preset:
        return PRESETS[args.preset]
    if args.alpha_us is None or args.beta_gbs is None:
        raise SystemExit("give --preset, or both --alpha-us and --beta-gbs")
    return Fabric(args.alpha_us * 1e-6, args.beta_gbs * 1e9, "given")


def explain_all_reduce(nbytes: float, n: int, alpha: float, beta: float) -> str:
    lat = 2 * (n - 1) * alpha
    bw = 2 * (n - 1) / n * nbytes / beta
    dom = "bandwidth" if bw >= lat else "latency"
    return (f"ring all-reduce of {nbytes / 1e6:g} MB over {n} ranks at alpha={alpha * 1e6:g} us, "
            f"beta={beta / 1e9:g} GB/s:\n"
            f"  latency term   2(n-1)*alpha     = {lat * 1e3:.4f} ms\n"
            f"  bandwidth term 2(n-1)/n*M/beta  = {bw * 1e3:.4f} ms\n"
            f"  total                           = {(lat + bw) * 1e3:.4f} ms  ({dom}-dominated)\n"
            f"  busbw {nbytes / (lat + bw) * 2 * (n - 1) / n / 1e9:.2f} GB/s; the latency term equals the "
            f"bandwidth term at M = {alpha * beta * n / 1e6:.3f} MB")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minddp.costmodel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("allreduce", "ddp"):
        p = sub.add_parser(name)
        p.add_argument("--preset", choices=sorted(PRESETS))
        p.add_argument("--alpha-us", type=float)
        p.add_argument("--beta-gbs", type=float)
        if name == "allreduce":
            p.add_argument("--size", type=parse_size, required=True)
            p.add_argument("--n", type=int, required=True)
        else:
            p.add_argument("--params", type=parse_size, required=True)
            p.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_BYTES))
            p.add_argument("--world", type=int, required=True)
            p.add_argument("--bucket-mb", type=float, default=25.0)
            p.add_argument("--compute-ms", type=float, help="measured forward+backward time per step")
    sub.add_parser("presets")
    args = ap.parse_args(argv)
    if args.cmd == "presets":
        for k, f in PRESETS.items():
            print(f"{k:18s} alpha {f.alpha * 1e6:7.1f} us  beta {f.beta / 1e9:7.1f} GB/s  {f.note}")
        return
    fab = _fabric(args)
    if args.cmd == "allreduce":
        print(explain_all_reduce(args.size, args.n, fab.alpha, fab.beta))
        return
    bpp = DTYPE_BYTES[args.dtype]
    c = ddp_comm_time(args.params, bpp, args.bucket_mb, args.world, fab.alpha, fab.beta)
    print(f"DDP gradients: {args.params / 1e6:g}M params x {bpp} B = {c['bytes'] / 1e6:.1f} MB in "
          f"{c['buckets']} buckets (cap {args.bucket_mb:g} MB) over {args.world} ranks")
    print(f"  latency {c['latency_s'] * 1e3:.3f} ms + bandwidth {c['bandwidth_s'] * 1e3:.3f} ms "
          f"= {c['total_s'] * 1e3:.3f} ms per step")
    if args.compute_ms is not None:
        bwd = args.compute_ms * 1e-3 * 2 / 3  # backward is about 2/3 of forward+backward
        exp = exposed_comm(c, bwd)
        bound = "communication" if c["total_s"] > bwd else "compute"
        cap, best = best_bucket_mb(args.params, bpp, args.world, fab.alpha, fab.beta, bwd)
        print(f"  backward ~{bwd * 1e3:.1f} ms: {bound}-bound; exposed communication "
              f"{exp * 1e3:.3f} ms with overlap ({exp / (args.compute_ms * 1e-3 + exp):.1%} of the step)")
        print(f"  bucket size with least exposed communication: {cap:g} MB ({best * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
