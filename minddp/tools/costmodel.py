"""The cost model from the command line: `minddp costmodel {allreduce,ddp,zero,tree,hier,presets}`.

    minddp costmodel allreduce --size 512MB --n 16 --alpha-us 5 --beta-gbs 50
    minddp costmodel ddp --params 124M --dtype bf16 --world 16 --preset ib-ndr --compute-ms 300

The formulas are in minddp/perf/costmodel.py, memory per rank in minddp/perf/memory.py.
"""

from __future__ import annotations

import argparse

from ..perf import costmodel as cm
from ..perf.costmodel import (
    DTYPE_BYTES,
    PRESETS,
    Calibration,
    Fabric,
    best_bucket_mb,
    ddp_comm_time,
    exposed_comm,
    inter_node_bytes,
    tree_beats_ring_below,
    zero1_comm_time,
)
from ..perf.memory import memory_per_rank
from .cli import parse_size


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minddp costmodel", description=cm.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, title="commands (`minddp costmodel COMMAND --help`)")
    hier = sub.add_parser("hier", help="inter-node bytes: flat ring against hierarchical")
    hier.add_argument("--nodes", type=int, required=True)
    hier.add_argument("--per-node", type=int, required=True)
    hier.add_argument("--size", type=parse_size, required=True)
    helps = {"allreduce": "one all-reduce of --size over --n ranks: latency and bandwidth terms",
             "ddp": "a DDP step's gradient all-reduces, exposed time, the best bucket cap",
             "zero": "ZeRO-1: memory per rank and the reduce-scatter + all-gather time",
             "tree": "tree against ring all-reduce: where the crossover lies"}
    for name in ("allreduce", "ddp", "zero", "tree"):
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("--preset", choices=sorted(PRESETS))
        p.add_argument("--calibration", metavar="FILE", help="JSON from `make calibrate`")
        p.add_argument("--alpha-us", type=float)
        p.add_argument("--beta-gbs", type=float)
        if name == "allreduce":
            p.add_argument("--size", type=parse_size, required=True)
            p.add_argument("--n", type=int, required=True)
        elif name == "tree":
            p.add_argument("--n", type=int, required=True)
        else:
            p.add_argument("--params", type=parse_size, required=True)
            p.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_BYTES))
            p.add_argument("--world", type=int, required=True)
            p.add_argument("--bucket-mb", type=float, default=25.0)
            p.add_argument("--compute-ms", type=float, help="measured forward+backward time per step")
    sub.add_parser("presets", help="the fabric presets (--preset NAME): alpha and beta of each")
    return ap


def _fabric(args) -> Fabric:
    if getattr(args, "calibration", None):
        return Calibration.load(args.calibration).fabric
    if args.preset:
        return PRESETS[args.preset]
    if args.alpha_us is None or args.beta_gbs is None:
        raise SystemExit("give --preset, or both --alpha-us and --beta-gbs")
    return Fabric(args.alpha_us * 1e-6, args.beta_gbs * 1e9, "given")


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    if args.cmd == "hier":
        print(explain_hierarchical(args.size, args.nodes, args.per_node))
        return
    if args.cmd == "presets":
        for k, f in PRESETS.items():
            print(f"{k:18s} alpha {f.alpha * 1e6:7.1f} us  beta {f.beta / 1e9:7.1f} GB/s  {f.note}")
        return
    fab = _fabric(args)
    if args.cmd == "allreduce":
        print(explain_all_reduce(args.size, args.n, fab.alpha, fab.beta))
        return
    if args.cmd == "tree":
        print(explain_tree(args.n, fab))
        return
    if args.cmd == "zero":
        print(explain_zero(args.params, DTYPE_BYTES[args.dtype], args.bucket_mb, args.world, fab))
        return
    print(_explain_ddp(args, fab))


def _explain_ddp(args, fab) -> str:
    out = []
    bpp = DTYPE_BYTES[args.dtype]
    c = ddp_comm_time(args.params, bpp, args.bucket_mb, args.world, fab.alpha, fab.beta)
    out.append(f"DDP gradients: {args.params / 1e6:g}M params x {bpp} B = {c['bytes'] / 1e6:.1f} MB in "
          f"{c['buckets']} buckets (cap {args.bucket_mb:g} MB) over {args.world} ranks")
    out.append(f"  latency {c['latency_s'] * 1e3:.3f} ms + bandwidth {c['bandwidth_s'] * 1e3:.3f} ms "
          f"= {c['total_s'] * 1e3:.3f} ms per step")
    if args.compute_ms is not None:
        bwd = args.compute_ms * 1e-3 * 2 / 3  # backward is about 2/3 of forward+backward
        exp = exposed_comm(c, bwd)
        bound = "communication" if c["total_s"] > bwd else "compute"
        cal = Calibration.load(args.calibration) if args.calibration else None
        cap, best = best_bucket_mb(args.params, bpp, args.world, fab.alpha, fab.beta, bwd, calibration=cal)
        out.append(f"  backward ~{bwd * 1e3:.1f} ms: {bound}-bound; exposed communication "
                   f"{exp * 1e3:.3f} ms with overlap "
                   f"({exp / (args.compute_ms * 1e-3 + exp):.1%} of the step)")
        out.append(f"  bucket size that adds the least to the step: {cap:g} MB "
                   f"({best * 1e3:.3f} ms exposed or taken from backward)")

    return "\n".join(out)


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


def explain_hierarchical(nbytes: float, nodes: int, per_node: int) -> str:
    v = inter_node_bytes(nbytes, nodes, per_node)
    n = nodes * per_node
    return (f"all-reduce of M = {nbytes / 1e6:g} MB over {nodes} nodes x {per_node} ranks:\n"
            f"  flat ring of {n}: each inter-node link carries 2(n-1)/n M = {v['flat_ring'] / 1e6:g} MB "
            f"per direction\n"
            f"  hierarchical: reduce in the node, ring among {nodes} leaders, broadcast in the node: "
            f"{v['hierarchical'] / 1e6:g} MB per leader link per direction "
            f"({v['flat_ring'] / v['hierarchical']:.2f}x less)")


def explain_tree(n: int, fab: Fabric) -> str:
    piped = tree_beats_ring_below(n, fab.alpha, fab.beta, pipelined=True)
    whole = tree_beats_ring_below(n, fab.alpha, fab.beta, pipelined=False)
    return (f"{n} ranks, alpha {fab.alpha * 1e6:g} us, beta {fab.beta / 1e9:g} GB/s: latency 2(n-1)a for "
            f"the ring against 2 ceil(log2 n) a for a tree.\n"
            f"  a pipelined tree beats the ring below {piped / 1e6:.3f} MB\n"
            f"  a whole-message tree (minddp.comm.collectives.tree_all_reduce) beats it below "
            f"{whole / 1e6:.3f} MB")


def explain_zero(n_params: float, bpp: int, bucket_mb: float, world: int, fab: Fabric) -> str:
    d = ddp_comm_time(n_params, bpp, bucket_mb, world, fab.alpha, fab.beta)
    z = zero1_comm_time(n_params, bpp, bucket_mb, world, fab.alpha, fab.beta)
    m_ddp = memory_per_rank(n_params, world, bpp, bpp)
    m_zero = memory_per_rank(n_params, world, bpp, bpp, sharded=True)
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    return (f"{n_params / 1e6:g}M parameters over {world} data-parallel ranks, AdamW (8 B of state per "
            f"parameter):\n"
            f"  DDP    all-reduce {d['total_s'] * 1e3:.3f} ms; memory per rank {gb(m_ddp['total'])} = "
            f"weights {gb(m_ddp['weights'])} + gradients {gb(m_ddp['gradients'])} + states "
            f"{gb(m_ddp['optimizer_states'])}\n"
            f"  ZeRO-1 reduce-scatter {z['reduce_scatter_s'] * 1e3:.3f} ms + all-gather "
            f"{z['all_gather_s'] * 1e3:.3f} ms (the same bytes); memory per rank {gb(m_zero['total'])} = "
            f"weights + gradients + states/{world} ({gb(m_zero['optimizer_states'])})")


if __name__ == "__main__":
    main()
