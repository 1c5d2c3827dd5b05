"""Scaling study: the trainer over world sizes and bucket caps, same global batch.

    python -m minddp.scaling [--worlds 1,2,4] [--caps 1,25] [--steps 20] [--out docs/scaling]

Each run is a real `torchrun train.py` with its own run directory under outputs/ and all of
them in one W&B group. From each run's metrics.jsonl (steps after the warm-up) it takes the
median step time, throughput, communication time and exposed communication, computes the
strong-scaling efficiency T1 / (n * Tn) (the global batch is fixed, so ideal is 1), and puts
the alpha-beta model's prediction of the gradient all-reduce time beside the measurement.
Writes <out>.md (a table) and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .cli import pyplot
from .costmodel import PRESETS, ddp_comm_time

ROOT = Path(__file__).resolve().parents[1]


def run(world: int, cap: float, steps: int, group: str, out_dir: Path, extra: list[str]) -> Path:
    run_dir = out_dir / f"ws{world}-cap{cap:g}"
    args = [f"train.max_steps={steps}", "train.eval_every=0", "train.ckpt_every=0",
            f"ddp.bucket_cap_mb={cap}", f"wandb.group={group}", *extra]
    bin_dir = Path(sys.executable).parent
    cmd = ([sys.executable, str(ROOT / "train.py")] if world == 1 else
           [str(bin_dir / "torchrun"), "--standalone", f"--nproc_per_node={world}", str(ROOT / "train.py")])
    env = {**os.environ, "MINDDP_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd + args, cwd=ROOT, env=env, check=True, capture_output=True)
    return run_dir


def summarize(run_dir: Path, warmup: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"step_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"),
            "comm_s": med("comm/busy_s"), "exposed_s": med("comm/exposed_wait_s"),
            "bytes": rows[-1]["comm/bytes"], "collectives": rows[-1]["comm/collectives"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minddp.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--caps", default="1,25")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="docs/scaling")
    ap.add_argument("--preset", default="this-machine-gloo")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    caps = [float(c) for c in args.caps.split(",")]
    group = f"scaling-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = ROOT / "outputs" / group
    fab = PRESETS[args.preset]
    results = []
    for cap in caps:
        for world in worlds:
            print(f"running world {world}, bucket cap {cap:g} MB ...", flush=True)
            s = summarize(run(world, cap, args.steps, group, out_dir, args.overrides), args.warmup)
            n_params = s["bytes"] / 4
            s["predicted_comm_s"] = ddp_comm_time(n_params, 4, cap, world, fab.alpha, fab.beta)["total_s"]
            results.append({"world": world, "cap": cap, **s})
    base = {r["cap"]: r["step_s"] for r in results if r["world"] == 1}
    for r in results:
        r["efficiency"] = base[r["cap"]] / (r["world"] * r["step_s"]) if r["cap"] in base else float("nan")
    cmd = f"python -m minddp.scaling --worlds {args.worlds} --caps {args.caps}"
    lines = [f"Command: `make scaling` (`{cmd}`); "
             f"W&B group `{group}`; prediction: ring all-reduce per bucket with the `{args.preset}` preset "
             f"(alpha {fab.alpha * 1e6:g} us, beta {fab.beta / 1e9:g} GB/s).", "",
             "| world | cap (MB) | buckets | step (ms) | tokens/s | efficiency | comm measured (ms) "
             "| comm predicted (ms) | exposed (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['world']} | {r['cap']:g} | {r['collectives']} | {r['step_s'] * 1e3:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['efficiency']:.2f} | {r['comm_s'] * 1e3:.1f} | "
                     f"{r['predicted_comm_s'] * 1e3:.1f} | {r['exposed_s'] * 1e3:.1f} |")
    table = "\n".join(lines)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text(table + "\n")
    plot(results, worlds, caps, args.out + ".png")
    print(f"wrote {args.out}.md and {args.out}.png; runs in {out_dir}")


def plot(results, worlds, caps, png) -> None:
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for cap in caps:
        rs = [r for r in results if r["cap"] == cap]
        a.plot([r["world"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=f"cap {cap:g} MB")
        b.plot([r["world"] for r in rs], [r["comm_s"] * 1e3 for r in rs], "o-", label=f"measured, {cap:g} MB")
        b.plot([r["world"] for r in rs], [r["predicted_comm_s"] * 1e3 for r in rs], "x--",
               label=f"alpha-beta model, {cap:g} MB")
    a.set(xlabel="world size", ylabel="tokens / s", title="throughput (fixed global batch)", xticks=worlds)
    b.set(xlabel="world size", ylabel="ms per step", title="gradient all-reduce time", xticks=worlds)
    a.legend()
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
