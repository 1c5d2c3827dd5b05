"""The checkpoint stall of whole runs, as a new user meets it: what a checkpoint every step costs a
run with minddp's defaults, against the same run without them.

    python scripts/bench_checkpoint_runs.py --rounds 3 --out docs/bench_checkpoint_runs.md

Each run is `torchrun --nproc_per_node=2 train.py` (gloo on the CPU here, one core per rank):
ZeRO-1, an 11M-parameter GPT (6 x 384), 16 steps, data and everything else as the defaults.
Variants, interleaved in rotated order within each round:
  none       train.ckpt_every=0 (only the run's final save, which every variant makes)
  defaults   train.ckpt_every=1 and nothing else: today's format, async choice and retention
  file       train.ckpt_every=1 with 0.5's defaults (ckpt_format=file, ckpt_keep=0)
  async      train.ckpt_every=1 train.ckpt_async=true
Per run: the wall time of the job, the loop's time (train.log, from the start-up line on
checkpoints to the closing one: no start-up, no teardown), the peak RSS of the busiest rank
(metrics.jsonl), and what the run's checkpoints take on disk at its end. Ratios are over the
`none` run of the same round; medians (min-max) over rounds, with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model.n_layer=6", "model.n_embd=384", "model.n_head=6", "ddp.shard_optimizer=true",
        "train.max_steps=16", "train.eval_every=0", "wandb.mode=disabled"]
VARIANTS = {"none": ["train.ckpt_every=0"], "defaults": ["train.ckpt_every=1"],
            "file": ["train.ckpt_every=1", "train.ckpt_format=file", "train.ckpt_keep=0"],
            "async": ["train.ckpt_every=1", "train.ckpt_async=true"]}
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def loop_seconds(log_text: str) -> float:
    """From the start-up line on checkpoints to the run's closing one, by their timestamps."""
    def at(pred):
        line = next(x for x in log_text.splitlines() if pred(x))
        return datetime.strptime(STAMP.match(line).group(1), "%Y-%m-%d %H:%M:%S,%f")
    start = at(lambda x: "] - checkpoints: " in x and "written in" in x)
    end = at(lambda x: "] - checkpoints: " in x and "on disk" in x)
    return (end - start).total_seconds()


def one_run(variant: str, work: Path, nproc: int, overrides=()) -> dict:
    run = work / f"{variant}-{time.monotonic_ns()}"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), *BASE, *VARIANTS[variant], *overrides]
    env = {**os.environ, "MINDDP_RUN_DIR": str(run), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{variant} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    disk = re.findall(r"([\d.]+) MiB on disk", (run / "train.log").read_text())
    out = {"wall": wall, "loop": loop_seconds((run / "train.log").read_text()),
           "peak_rss_mb": max(r.get("mem/peak_rss_mb", 0) for r in rows), "disk_mb": float(disk[-1])}
    shutil.rmtree(run, ignore_errors=True)
    return out


def spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(results: dict, variants: list[str], rounds: int, load: tuple) -> str:
    lines = ["# What a checkpoint every step costs a whole run (11M GPT, dp 2, ZeRO-1, 16 steps, CPU)", "",
             "Written by `make bench-checkpoint` (scripts/bench_checkpoint_runs.py): each variant a "
             "`torchrun --nproc_per_node=2 train.py` job, interleaved in rotated order in each of "
             f"{rounds} rounds; ratios over the round's `none` run; medians (min-max). Load average "
             f"(1 min) {load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} cores.", "",
             "| variant | run (s) | run / none | loop (s) | loop / none | peak RSS, busiest rank (MiB) | "
             "checkpoints on disk at the end (MiB) |", "|---|---|---|---|---|---|---|"]
    for v in variants:
        rs = results[v]
        wall = [r["wall"] / n["wall"] for r, n in zip(rs, results["none"])]
        loop = [r["loop"] / n["loop"] for r, n in zip(rs, results["none"])]
        lines.append(f"| {v} | {spread([r['wall'] for r in rs])} | {spread(wall)} | "
                     f"{spread([r['loop'] for r in rs])} | {spread(loop)} | "
                     f"{spread([r['peak_rss_mb'] for r in rs])} | {spread([r['disk_mb'] for r in rs])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", type=lambda s: s.split(","), default=["none", "defaults"],
                    help=f"comma-separated, of {','.join(VARIANTS)} (none is always run)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=None, help="a markdown file for the table")
    ap.add_argument("--json", default=None)
    ap.add_argument("--overrides", nargs="*", default=[],
                    help="Hydra overrides after the bench's own (a smaller model for a smoke test)")
    args = ap.parse_args()
    variants = ["none"] + [v for v in args.variants if v != "none"]
    if set(variants) - set(VARIANTS):
        ap.error(f"--variants: choose from {','.join(VARIANTS)}")
    results = {v: [] for v in variants}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-runs-") as tmp:
        for r in range(args.rounds):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                results[v].append(one_run(v, Path(tmp), args.nproc, args.overrides))
                print(f"round {r + 1} {v}: {results[v][-1]}", flush=True)
    text = table(results, variants, args.rounds, (load_before, os.getloadavg()[0]))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
