"""The cost model from the command line: `minddp costmodel {allreduce,ddp,zero,tree,hier,presets}`.

    minddp costmodel allreduce --size 512MB --n 16 --alpha-us 5 --beta-gbs 50
    minddp costmodel ddp --params 124M --dtype bf16 --world 16 --preset ib-ndr --compute-ms 300

The formulas are in minddp/perf/costmodel.py, memory per rank in minddp/perf/memory.py, the
cases in words in minddp/perf/explain.py.
"""

from __future__ import annotations

import argparse
import math

from ..errors import ConfigError
from ..perf import costmodel as cm
from ..perf.costmodel import DTYPE_BYTES, PRESETS, Calibration, Fabric, inter_node_bytes  # noqa: F401
from ..perf.explain import (  # noqa: F401  (0.3's minddp.costmodel names, minddp/_moved.py)
    explain_all_reduce,
    explain_ddp,
    explain_hierarchical,
    explain_tree,
    explain_zero,
)
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


# option -> the least value it takes and whether that value itself is allowed (NaN and inf never)
LIMITS = {"size": (0, False), "params": (0, False), "nodes": (1, True), "per_node": (1, True), "n": (1, True),
          "world": (1, True), "alpha_us": (0, True), "beta_gbs": (0, False), "bucket_mb": (0, False),
          "compute_ms": (0, True)}


def input_problem(args) -> str | None:
    """The first option no network or model can have (a size of 0, a world of -2, a NaN
    bandwidth), named with what it takes; None when all are possible."""
    for key, (least, allowed) in LIMITS.items():
        value = getattr(args, key, None)
        if value is None:
            continue
        ok = math.isfinite(value) and (value >= least if allowed else value > least)
        if not ok:
            return (f"--{key.replace('_', '-')} {value:g} is not possible: it must be a finite number "
                    f"{'>=' if allowed else '>'} {least}")
    return None


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    if (problem := input_problem(args)) is not None:
        raise ConfigError(problem)  # one line and exit 2 (minddp.tools.main)
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
