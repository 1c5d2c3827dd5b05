"""What the never-hang machinery costs per collective: `make bench-debug`.

    TORCH_FR_BUFFER_SIZE=2000 torchrun --standalone --nproc_per_node=2 -m minddp bench-debug

Times `--iters` 1 KB all-reduces on a plain group and on a group created under
TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's collective fingerprints), interleaved in blocks of
`--block`; prints one JSON line: median microseconds per collective for each, and whether
torch's flight recorder was recording (TORCH_FR_BUFFER_SIZE, process-wide, so `make
bench-debug` runs this with it off and on, alternately). The measurement is
minddp/perf/fingerprints.py.
"""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from ..perf.fingerprints import fingerprint_cost
from .arguments import positive_int, tool_parser
from .cli import start


def main(argv=None) -> None:
    ap = tool_parser("bench-debug", __doc__, argparse.RawTextHelpFormatter)
    ap.add_argument("--iters", type=positive_int, default=2000)
    ap.add_argument("--block", type=positive_int, default=100)
    args = ap.parse_args(argv)
    medians = fingerprint_cost(start(pin=True).device, args.iters, args.block)
    if dist.get_rank() == 0:
        fr = int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0)
        print(json.dumps({"flight_recorder": fr, **medians}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
