"""Scaling study: the trainer over world sizes and bucket caps, same global batch, with the
calibrated cost model's prediction beside every measurement.

    minddp scaling [--worlds 1,2,4] [--caps 1,5,25,100] [--steps 16] [--out docs/scaling]

Each run is a real `torchrun train.py` with its own run directory under outputs/ and all of
them in one W&B group. From each run's metrics.jsonl (steps after the warm-up) it takes the
median step time, throughput, the engine's communication busy time (at least one bucket in
flight) and exposed wait, computes the strong-scaling efficiency T1 / (n * Tn) (the global
batch is fixed, so ideal is 1), and predicts busy and exposed time with
`costmodel.predict_ddp_comm` and the calibration of `make calibrate` (alpha, beta, the
contention factor and the engine's per-bucket cost, measured on this machine). Rows whose
world size x threads exceed the machine's cores are marked oversubscribed: ranks time-share
cores there, so efficiency says nothing about the method. Writes <out>.md and <out>.png.
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

from ..costmodel import PRESETS, Calibration, predict_ddp_comm
from .cli import pyplot

ROOT = Path(__file__).resolve().parents[2]  # the repository: train.py, outputs/
MODEL = ["model.n_layer=6", "model.n_embd=384", "model.n_head=6", "model.block_size=128",
         "train.global_batch_size=8", "train.micro_batch_size=2", "data=synthetic"]


def run(world: int, cap: float, steps: int, group: str, out_dir: Path, extra: list[str]) -> Path:
    run_dir = out_dir / f"ws{world}-cap{cap:g}"
    args = [f"train.max_steps={steps}", "train.eval_every=0", "train.ckpt_every=0",
            f"ddp.bucket_cap_mb={cap}", f"wandb.group={group}", *extra]
    bin_dir = Path(sys.executable).parent
    cmd = ([sys.executable, str(ROOT / "train.py")] if world == 1 else
           [str(bin_dir / "torchrun"), "--standalone", f"--nproc_per_node={world}", str(ROOT / "train.py")])
    env = {**os.environ, "MINDDP_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd + args, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"minddp.tools.scaling: world {world}, cap {cap:g} failed (exit {p.returncode}):\n"
                         f"{p.stderr[-4000:]}")
    return run_dir


def summarize(run_dir: Path, warmup: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"step_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"),
            "busy_s": med("comm/busy_s"), "exposed_s": med("comm/exposed_wait_s"),
            "bytes": rows[-1]["comm/bytes"], "collectives": rows[-1]["comm/collectives"]}


def predict(s: dict, world: int, cal: Calibration) -> dict:
    """The model's busy and exposed time for the run's own buckets; backward taken as 2/3 of
    the step's compute (the step minus its exposed wait)."""
    buckets = [s["bytes"] / s["collectives"]] * s["collectives"] if s["collectives"] else []
    backward = (s["step_s"] - s["exposed_s"]) * 2 / 3
    return predict_ddp_comm(buckets, world, cal, backward)


def calibration(path: str | None, preset: str) -> Calibration:
    if path and Path(path).exists():
        return Calibration.load(path)
    return Calibration(PRESETS[preset])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="minddp scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--caps", default="1,5,25,100")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", default="docs/scaling")
    ap.add_argument("--calibration", default="docs/calibration.json", help="from `make calibrate`")
    ap.add_argument("--preset", default="this-machine-gloo", help="when there is no calibration file")
    ap.add_argument("--reuse", metavar="DIR", help="re-read the runs of an earlier study instead of running")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after the study's model)")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    caps = [float(c) for c in args.caps.split(",")]
    group = Path(args.reuse).name if args.reuse else f"scaling-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(args.reuse) if args.reuse else ROOT / "outputs" / group
    cal = calibration(args.calibration, args.preset)
    results = []
    for cap in caps:
        for world in worlds:
            print(f"running world {world}, bucket cap {cap:g} MB ...", flush=True)
            run_dir = (out_dir / f"ws{world}-cap{cap:g}" if args.reuse else
                       run(world, cap, args.steps, group, out_dir, MODEL + args.overrides))
            s = summarize(run_dir, args.warmup)
            p = predict(s, world, cal)
            results.append({"world": world, "cap": cap, **s, "predicted_busy_s": p["busy_s"],
                            "predicted_exposed_s": p["exposed_s"]})
    cores = len(os.sched_getaffinity(0))
    base = {r["cap"]: r["step_s"] for r in results if r["world"] == 1}
    floor = {r["cap"]: r["busy_s"] for r in results if r["world"] == 1}  # nothing crosses a wire
    for r in results:
        r["floor_s"] = floor.get(r["cap"], 0.0)
    for r in results:
        r["oversubscribed"] = r["world"] * 1 > cores  # one thread per rank
        r["efficiency"] = base[r["cap"]] / (r["world"] * r["step_s"]) if r["cap"] in base else float("nan")
    table = report(args, group, cal, cores, results)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text(table + "\n")
    plot(results, worlds, caps, args.out + ".png")
    print(f"wrote {args.out}.md and {args.out}.png; runs in {out_dir}")


def report(args, group, cal, cores, results) -> str:
    f = cal.fabric
    cmd = f"minddp scaling --worlds {args.worlds} --caps {args.caps}"
    lines = [f"Command: `make scaling` (`{cmd}`); "
             f"W&B group `{group}`; GPT 6 layers x 384 (10.8M parameters), global batch 8 x 128 tokens, "
             f"1 thread per rank on {cores} cores. Prediction: `costmodel.predict_ddp_comm` with "
             f"alpha {f.alpha * 1e6:.0f} us, beta {f.beta / 1e9:.2f} GB/s, "
             f"contention x{cal.contention:.2f}, "
             f"engine {cal.overhead_per_bucket_s * 1e6:.0f} us per bucket ({f.note}).", "",
             "| world | cap (MB) | buckets | step (ms) | tokens/s | efficiency | busy measured (ms) "
             "| busy predicted (ms) | predicted / measured | + world-1 floor / measured "
             "| exposed measured (ms) | exposed predicted (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        eff = "oversubscribed" if r["oversubscribed"] else f"{r['efficiency']:.2f}"
        multi = r["world"] > 1 and r["busy_s"]
        ratio = f"{r['predicted_busy_s'] / r['busy_s']:.2f}" if multi else "-"
        floored = f"{(r['predicted_busy_s'] + r['floor_s']) / r['busy_s']:.2f}" if multi else "-"
        lines.append(f"| {r['world']} | {r['cap']:g} | {r['collectives']} | {r['step_s'] * 1e3:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {eff} | {r['busy_s'] * 1e3:.1f} | "
                     f"{r['predicted_busy_s'] * 1e3:.1f} | {ratio} | {floored} | "
                     f"{r['exposed_s'] * 1e3:.1f} | "
                     f"{r['predicted_exposed_s'] * 1e3:.1f} |")
    lines += ["", *reading(results)]
    return "\n".join(lines)


def reading(results) -> list[str]:
    """What the table says, from its own numbers: which term the model lacks."""
    w1 = {r["cap"]: r for r in results if r["world"] == 1}
    w2 = [r for r in results if r["world"] == 2 and r["busy_s"]]
    if not w1 or not w2:
        return []
    small = min(w1.values(), key=lambda r: r["cap"])
    within = [f"{r['cap']:g} MB" for r in w2 if abs(r["predicted_busy_s"] / r["busy_s"] - 1) <= 0.2]
    floored = [f"{r['cap']:g} MB" for r in w2
               if abs((r["predicted_busy_s"] + r["floor_s"]) / r["busy_s"] - 1) <= 0.2]
    per = small["busy_s"] / small["collectives"] * 1e3
    return [
        "Reading it. At world 2 the calibrated prediction is within 20% of the measured busy time "
        f"at {', '.join(within) or 'no cap'}. The term it lacks shows in the world-1 rows, where "
        f"nothing crosses a wire and busy is still {small['busy_s'] * 1e3:.0f} ms over "
        f"{small['collectives']} buckets at {small['cap']:g} MB ({per:.1f} ms a bucket): the engine "
        "learns that a collective finished through a callback on the communication thread, which "
        "needs the GIL, and a backward thread holding it yields only every switch interval (5 ms), "
        "so a bucket counts as busy until it is noticed, not just until it is done. Adding that "
        f"measured world-1 floor to the prediction brings {', '.join(floored) or 'no cap'} within 20%; "
        "what remains at the largest cap is bandwidth: the fit's beta is set by the mid-size "
        "messages, and one 43 MB message moves faster. Rows at world 4 are oversubscribed (4 ranks "
        "on 2 cores): they time-share cores, which no per-collective model captures, and their "
        "efficiency is not reported."]


def plot(results, worlds, caps, png) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for cap in caps:
        rs = [r for r in results if r["cap"] == cap]
        a.plot([r["world"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=f"cap {cap:g} MB")
        b.plot([r["world"] for r in rs], [r["busy_s"] * 1e3 for r in rs], "o-", label=f"measured, {cap:g} MB")
        b.plot([r["world"] for r in rs], [r["predicted_busy_s"] * 1e3 for r in rs], "x--",
               label=f"calibrated model, {cap:g} MB")
    a.set(xlabel="world size", ylabel="tokens / s", title="throughput (fixed global batch)", xticks=worlds)
    b.set(xlabel="world size", ylabel="ms per step", title="gradient communication busy time", xticks=worlds)
    a.legend()
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
