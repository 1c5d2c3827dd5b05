"""Peak resident memory per rank, DDP against ZeRO-1, in separate processes (make bench).

    minddp bench-memory [--append docs/bench_ddp.md]

One process cannot separate the peaks of configurations it interleaves, so this runs
`train.py` twice on the bench's GPT (2 ranks, 8 steps, AdamW), with and without
`ddp.shard_optimizer=true`, and reads `mem/peak_rss_mb` (the largest rank's) from each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["model.n_layer=6", "model.n_embd=384", "model.n_head=6", "model.block_size=128",
        "train.global_batch_size=8", "train.micro_batch_size=4", "data=synthetic", "train.max_steps=8",
        "train.eval_every=0", "train.ckpt_every=0", "wandb.mode=disabled", "ddp.bucket_cap_mb=25"]


def peak_rss_mb(sharded: bool, nproc: int = 2) -> float:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "train.py"), *ARGS,
           f"ddp.shard_optimizer={str(sharded).lower()}"]
    env = {**os.environ, "MINDDP_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"minddp.tools.bench_memory: train.py failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["mem/peak_rss_mb"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="minddp bench-memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--append", help="append the table to this markdown file")
    args = ap.parse_args(argv)
    plain, sharded = peak_rss_mb(False), peak_rss_mb(True)
    table = "\n".join([
        "", "Peak resident memory of the largest rank (`minddp bench-memory`: `train.py`, "
        "same GPT, 2 ranks, 8 steps, fused AdamW; separate processes):", "",
        "| configuration | peak RSS per rank (MB) |", "|---|---|",
        f"| minddp DDP | {plain:.0f} |", f"| minddp shard_optimizer (ZeRO-1) | {sharded:.0f} |"])
    print(table)
    if args.append:
        with open(args.append, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
