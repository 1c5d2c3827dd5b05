"""python -m minddp.demos NAME (under torchrun); --help lists the demos."""

import argparse
import importlib

import torch.distributed as dist

from minddp.demos import DEMOS, MODULES
from minddp.parallel.dist import init_distributed, shutdown


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m minddp.demos",
        description="\n".join(f"  {k:18s} {v}" for k, v in DEMOS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(DEMOS), metavar="NAME", help="which demo (see above)")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="for `hierarchical`")
    args = ap.parse_args(argv)
    init_distributed()
    try:
        module = importlib.import_module(f"minddp.demos.{MODULES[args.name]}")
        kwargs = {"ranks_per_node": args.ranks_per_node} if args.name == "hierarchical" else {}
        # no `with torch.device(...)`: it would also redirect torch internals (DistributedSampler's
        # randperm on a CPU generator raised on CUDA); every demo names its device itself
        module.run(**kwargs)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"[{args.name}] all checks passed on {dist.get_world_size()} ranks")
    finally:
        shutdown()


if __name__ == "__main__":
    main()
