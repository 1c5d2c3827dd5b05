"""The cost model from the command line: `minddp costmodel {allreduce,ddp,zero,tree,hier,presets}`.

    minddp costmodel allreduce --size 512MB --n 16 --alpha-us 5 --beta-gbs 50
    minddp costmodel ddp --params 124M --dtype bf16 --world 16 --preset ib-ndr --compute-ms 300

The formulas are in minddp/perf/costmodel.py, memory per rank in minddp/perf/memory.py, the
cases in words in minddp/perf/explain.py.
"""

from __future__ import annotations

import argparse

from ..engine.options import DEFAULT_BUCKET_CAP_MB
from ..perf import costmodel as cm
from ..perf.costmodel import DTYPE_BYTES, PRESETS, Calibration, Fabric, inter_node_bytes  # noqa: F401
from ..perf.explain import (  # noqa: F401  (0.3's minddp.costmodel names, minddp/_moved.py)
    explain_all_reduce,
    explain_ddp,
    explain_hierarchical,
    explain_tree,
    explain_zero,
)
from .arguments import (
    calibration_file,
    nonnegative_float,
    parse_size,  # noqa: F401  (0.3's minddp.costmodel.parse_size, minddp/_moved.py)
    positive_float,
    positive_int,
    size,
    tool_parser,
)


def _parser() -> argparse.ArgumentParser:
    ap = tool_parser("costmodel", cm.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True, title="commands (`minddp costmodel COMMAND --help`)")
    hier = sub.add_parser("hier", help="inter-node bytes: flat ring against hierarchical")
    hier.add_argument("--nodes", type=positive_int, required=True)
    hier.add_argument("--per-node", type=positive_int, required=True)
    hier.add_argument("--size", type=size, required=True)
    helps = {"allreduce": "one all-reduce of --size over --n ranks: latency and bandwidth terms",
             "ddp": "a DDP step's gradient all-reduces, exposed time, the best bucket cap",
             "zero": "ZeRO-1: memory per rank and the reduce-scatter + all-gather time",
             "tree": "tree against ring all-reduce: where the crossover lies"}
    for name in ("allreduce", "ddp", "zero", "tree"):
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("--preset", choices=sorted(PRESETS))
        p.add_argument("--calibration", metavar="FILE", type=calibration_file,
                       help="JSON from `make calibrate`")
        p.add_argument("--alpha-us", type=nonnegative_float)
        p.add_argument("--beta-gbs", type=positive_float)
        if name == "allreduce":
            p.add_argument("--size", type=size, required=True)
            p.add_argument("--n", type=positive_int, required=True)
        elif name == "tree":
            p.add_argument("--n", type=positive_int, required=True)
        else:
            p.add_argument("--params", type=size, required=True)
            p.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_BYTES))
            p.add_argument("--world", type=positive_int, required=True)
            p.add_argument("--bucket-mb", type=positive_float, default=DEFAULT_BUCKET_CAP_MB)
            p.add_argument("--compute-ms", type=nonnegative_float,
                           help="measured forward+backward time per step")
    sub.add_parser("presets", help="the fabric presets (--preset NAME): alpha and beta of each")
    return ap


def _fabric(args) -> Fabric:
    if getattr(args, "calibration", None):
        return Calibration.load(args.calibration).fabric
    if args.preset:
        return PRESETS[args.preset]
    return Fabric(args.alpha_us * 1e-6, args.beta_gbs * 1e9, "given")


def parse(argv=None) -> argparse.Namespace:
    ap = _parser()
    args = ap.parse_args(argv)
    fabric_given = not hasattr(args, "preset") or args.calibration or args.preset
    if not fabric_given and (args.alpha_us is None or args.beta_gbs is None):
        ap.error(f"{args.cmd}: give --preset, --calibration, or both --alpha-us and --beta-gbs")
    return args


def main(argv=None) -> None:
    args = parse(argv)
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
    print(explain_ddp(args.params, args.dtype, args.bucket_mb, args.world, fab, args.compute_ms,
                      args.calibration))


if __name__ == "__main__":
    main()
