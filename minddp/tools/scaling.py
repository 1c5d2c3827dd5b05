"""Scaling study: the trainer over world sizes and bucket caps, same global batch, with the
calibrated cost model's prediction beside every measurement.

    minddp scaling [--worlds 1,2,4] [--caps 1,5,25,100] [--steps 16] [--out docs/scaling]
    minddp scaling --repeats 3 --variants auto      # make scaling: + ZeRO-1 (+ overlap) at world 2
    minddp scaling --mode weak                      # per-rank batch fixed: the global batch grows

Each run is a real `torchrun train.py` with its own run directory under outputs/ and all of
them in one W&B group. From each run's metrics.jsonl (steps after the warm-up) it takes the
median step time, throughput, the engine's communication busy time (at least one bucket in
flight) and exposed wait, computes the scaling efficiency (--mode strong, the default: the
global batch is fixed, T1 / (n * Tn); --mode weak, train.scaling=weak: each rank's batch is
fixed, T1 / Tn; ideal is 1 in both), and predicts busy and exposed time with
`costmodel.predict_ddp_comm` and the calibration of `make calibrate` (alpha, beta, the
contention factor, the engine's per-bucket cost and the per-bucket completion floor, measured
on this machine). With --repeats each configuration runs that often, the order rotated per
repeat, and the table gives medians and spreads. Rows whose
world size x threads exceed the machine's cores are marked oversubscribed: ranks time-share
cores there, so efficiency says nothing about the method. Writes <out>.md and <out>.png,
and at the end logs the study's W&B report run into its group (`minddp report --wandb`; each
run's W&B name holds its variant and repeat, wandb.repeat) and prints the one command that
uploads every offline run of the study.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..perf.costmodel import PRESETS, Calibration, best_bucket_mb, predict_ddp_comm
from ..train.model import GPT, GPTConfig
from . import render
from .calibrate import UNDER_CAPS
from .cli import pyplot
from .workload import GPT_PRESETS, STUDY, STUDY_BATCH, overrides

ROOT = Path(__file__).resolve().parents[2]  # the repository: train.py, outputs/
STUDY_GPT = GPT_PRESETS[STUDY]
MODEL = [*overrides(STUDY_GPT), f"train.global_batch_size={STUDY_BATCH[0]}",
         f"train.micro_batch_size={STUDY_BATCH[1]}", "data=synthetic"]


# variant -> the overrides that make it; run at world 2 beside DDP (make scaling: --variants auto)
# (the overlap steps each bucket before the global gradient norm exists: no clipping, and a
# non-finite step stops the run instead of being skipped)
VARIANTS = {"ddp": [], "zero1": ["ddp.shard_optimizer=true"],
            "overlap": ["ddp.optimizer_overlap=true", "optim.grad_clip=0", "train.on_nonfinite=stop"]}


def available_variants(spec: str) -> list[str]:
    """`auto`: every variant (DDP, ZeRO-1, the optimizer overlap)."""
    if spec == "auto":
        return list(VARIANTS)
    bad = [v for v in spec.split(",") if v not in VARIANTS]
    if bad:
        raise SystemExit(f"minddp scaling: unknown variant(s) {', '.join(bad)}; of {', '.join(VARIANTS)}")
    return spec.split(",")


def run_name(variant: str, world: int, cap: float, repeat: int) -> str:
    """ws2-cap25 (the first DDP run: the name earlier studies used), zero1-ws2-cap25-r1, ..."""
    prefix = "" if variant == "ddp" else f"{variant}-"
    return f"{prefix}ws{world}-cap{cap:g}" + (f"-r{repeat}" if repeat else "")


def run(run_dir: Path, world: int, cap: float, steps: int, group: str, extra: list[str]) -> None:
    args = [f"train.max_steps={steps}", "train.eval_every=0", "train.ckpt_every=0",
            f"ddp.bucket_cap_mb={cap}", f"wandb.group={group}", *extra]
    bin_dir = Path(sys.executable).parent
    cmd = ([sys.executable, str(ROOT / "train.py")] if world == 1 else
           [str(bin_dir / "torchrun"), "--standalone", f"--nproc_per_node={world}", str(ROOT / "train.py")])
    env = {**os.environ, "MINDDP_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd + args, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"minddp.tools.scaling: {run_dir.name} failed (exit {p.returncode}):\n"
                         f"{p.stderr[-4000:]}")


def summarize(run_dir: Path, warmup: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    load = run_dir / "load.json"
    return {"load": json.loads(load.read_text())["loadavg_1min"] if load.exists() else None,
            "step_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"),
            "busy_s": med("comm/busy_s"), "exposed_s": med("comm/exposed_wait_s"),
            "bytes": rows[-1]["comm/bytes"], "collectives": rows[-1]["comm/collectives"]}


def combine(runs: list[dict]) -> dict:
    """Several repeats of one configuration: medians, and the spread (min, max) of step and busy."""
    keys = ("step_s", "tokens_per_s", "busy_s", "exposed_s")
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    return {**out, "bytes": runs[0]["bytes"], "collectives": runs[0]["collectives"], "repeats": len(runs),
            "step_spread": (min(r["step_s"] for r in runs), max(r["step_s"] for r in runs)),
            "busy_spread": (min(r["busy_s"] for r in runs), max(r["busy_s"] for r in runs))}


def predict(s: dict, world: int, cal: Calibration, variant: str = "ddp", mode: str = "strong") -> dict:
    """The model's busy and exposed time for the run's own buckets. Backward: the synchronised
    micro-step's, from the step's compute (the step minus its exposed wait) split over the
    micro-steps, its share measured by `make calibrate` (2/3 without one). ZeRO-1
    reduce-scatters each bucket in backward (its all-gather is not in the engine's busy time);
    the optimizer overlap moves the same bytes as DDP. `alone_s`: the collectives as if
    nothing ran beside them (no contention, floor or slowdown)."""
    buckets = study_buckets(s["cap"], s["collectives"], s["bytes"])
    backward = (s["step_s"] - s["exposed_s"]) / accumulation(world, mode) * cal.backward_share
    op = "reduce_scatter" if variant == "zero1" else "all_reduce"
    full = predict_ddp_comm(buckets, world, cal, backward, op=op)
    alone = replace(cal, contention=1.0, floor_per_bucket_s=0.0, under_backward=())
    return {**full, "alone_s": predict_ddp_comm(buckets, world, alone, backward, op=op)["busy_s"]}


def accumulation(world: int, mode: str = "strong") -> int:
    """Micro-steps per step in the study (global batch 8, micro-batch 2; weak: 8 per rank)."""
    return max(1, STUDY_BATCH[0] // (STUDY_BATCH[1] * (1 if mode == "weak" else world)))


@functools.cache
def study_params() -> tuple[torch.Tensor, ...]:
    """The study GPT's trainable parameters on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return tuple(p for p in GPT(GPTConfig(**STUDY_GPT)).parameters() if p.requires_grad)


@functools.cache
def study_buckets(cap: float, count: int, nbytes: int) -> tuple[float, ...]:
    """The engine's bucket sizes (launch order) for the study's GPT at `cap`; equal shares of
    the measured bytes where the run had another number of buckets."""
    from ..engine.buckets import TensorSpec, assign_buckets

    params = study_params()
    plan = assign_buckets([TensorSpec.of(p) for p in params], list(reversed(range(len(params)))), cap)
    if len(plan) != count:
        return tuple([nbytes / count] * count) if count else ()
    return tuple(float(sum(params[i].numel() for i in b) * 4) for b in plan)


def calibration(path: str | None, preset: str) -> Calibration:
    if path and Path(path).exists():
        return Calibration.load(path)
    return Calibration(PRESETS[preset])


def plan(variants: list[str], worlds: list[int], caps: list[float], repeats: int) -> list[list[tuple]]:
    """The runs of each repeat, (variant, world, cap), rotated by a share each repeat so that a
    slow spell on the shared machine does not always hit the same configuration."""
    jobs = [(v, w, c) for c in caps for w in worlds for v in variants if v == "ddp" or w == 2]
    shift = max(1, len(jobs) // max(1, repeats))
    return [jobs[k * shift % len(jobs):] + jobs[:k * shift % len(jobs)] for k in range(repeats)]


def collect(args, variants, worlds, caps, out_dir: Path, group: str) -> dict:
    """{(variant, world, cap): [summary per repeat]}, running what --reuse does not supply."""
    runs: dict[tuple, list[dict]] = {}
    for k, jobs in enumerate(plan(variants, worlds, caps, args.repeats)):
        for v, w, c in jobs:
            run_dir = out_dir / run_name(v, w, c, k)
            if args.reuse and not (run_dir / "metrics.jsonl").exists():
                continue  # an earlier study without this variant or repeat
            if not args.reuse:
                print(f"repeat {k + 1}/{args.repeats}: {v}, world {w}, bucket cap {c:g} MB ...", flush=True)
                mode = [f"train.scaling={args.mode}", f"wandb.repeat={k}"]  # a W&B name per repeat
                run(run_dir, w, c, args.steps, group, MODEL + VARIANTS[v] + mode + args.overrides)
                # the machine's load as the run ended: others share these cores
                (run_dir / "load.json").write_text(json.dumps({"loadavg_1min": os.getloadavg()[0]}))
            runs.setdefault((v, w, c), []).append(summarize(run_dir, args.warmup))
    return runs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="minddp scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--caps", default="1,5,25,100")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each configuration, rotated order")
    ap.add_argument("--mode", choices=("strong", "weak"), default="strong",
                    help="strong: the global batch fixed; weak: each rank's batch fixed (train.scaling)")
    ap.add_argument("--variants", default="ddp",
                    help="ddp, zero1, overlap (at world 2, beside DDP), or auto (those the trainer has)")
    ap.add_argument("--out", default="docs/scaling")
    ap.add_argument("--calibration", default="docs/calibration.json", help="from `make calibrate`")
    ap.add_argument("--preset", default="this-machine-gloo", help="when there is no calibration file")
    ap.add_argument("--reuse", metavar="DIR", help="re-read the runs of an earlier study instead of running")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after the study's model)")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    caps = [float(c) for c in args.caps.split(",")]
    variants = available_variants(args.variants)
    group = Path(args.reuse).name if args.reuse else f"scaling-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(args.reuse) if args.reuse else ROOT / "outputs" / group
    cal = calibration(args.calibration, args.preset)
    runs = collect(args, variants, worlds, caps, out_dir, group)
    results = analyse(runs, cal, args.mode)
    blocks = report(args, group, cal, len(os.sched_getaffinity(0)), results) + load_note(runs)
    print(render.markdown(blocks))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    render.write(args.out + ".md", blocks, {"results": results})
    plot([r for r in results if r["variant"] == "ddp"], worlds, caps, args.out + ".png")
    if not args.reuse:  # the study as one W&B run, in the runs' group; the upload command once
        from .report import report as folder_report

        folder_report(out_dir, to_wandb=True)
    print(f"wrote {args.out}.md and {args.out}.png; runs in {out_dir}")


def load_note(runs: dict) -> list[str]:
    loads = sorted(r["load"] for rs in runs.values() for r in rs if r.get("load") is not None)
    if not loads:
        return []
    return [f"Machine load (1-minute load average as each run ended, {len(os.sched_getaffinity(0))} "
            f"cores): median {statistics.median(loads):.1f}, range {loads[0]:.1f}-{loads[-1]:.1f}. Other "
            "work on the shared machine slows communication and compute unevenly: that is what the "
            "spreads show."]


def analyse(runs: dict, cal: Calibration, mode: str = "strong") -> list[dict]:
    cores = len(os.sched_getaffinity(0))
    results = []
    for (v, w, c), rs in sorted(runs.items(), key=lambda kv: (kv[0][2], list(VARIANTS).index(kv[0][0]),
                                                             kv[0][1])):
        s = combine(rs)
        p = predict({**s, "cap": c}, w, cal, v, mode)
        results.append({"variant": v, "world": w, "cap": c, **s, "predicted_busy_s": p["busy_s"],
                        "predicted_exposed_s": p["exposed_s"], "alone_s": p["alone_s"]})
    base = {r["cap"]: r["step_s"] for r in results if r["world"] == 1 and r["variant"] == "ddp"}
    for r in results:
        r["oversubscribed"] = r["world"] * 1 > cores  # one thread per rank
        n = 1 if mode == "weak" else r["world"]  # weak: T1 / Tn; strong: T1 / (n Tn)
        r["efficiency"] = base[r["cap"]] / (n * r["step_s"]) if r["cap"] in base else float("nan")
    return results


def report(args, group, cal, cores, results) -> list:
    """The report's blocks (render.markdown)."""
    f, gpt, (batch, _) = cal.fabric, STUDY_GPT, STUDY_BATCH
    cmd = (f"minddp scaling --worlds {args.worlds} --caps {args.caps} --repeats {args.repeats} "
           f"--variants {args.variants} --steps {args.steps} --warmup {args.warmup}")
    if args.reuse:  # the runs of an earlier study, predicted again (e.g. after make calibrate)
        cmd += f" --reuse {Path(args.reuse).name}"
    weak = args.mode == "weak"
    cmd += " --mode weak" if weak else ""
    size = f" ({sum(p.numel() for p in study_params()) / 1e6:.1f}M parameters)"
    head = (f"Command: `{cmd}` (`make scaling` is `minddp scaling --repeats 3 --variants auto`); "
            f"W&B group `{group}`; GPT {gpt['n_layer']} layers x {gpt['n_embd']}{size}, "
            f"{'batch per rank' if weak else 'global batch'} {batch} x {gpt['block_size']} tokens, "
            f"{'weak scaling: efficiency T1 / Tn' if weak else 'strong scaling: efficiency T1 / (n Tn)'}, "
            f"1 thread per rank on {cores} cores; "
            f"{args.repeats} run(s) of each configuration in rotated order, medians (spread: min-max "
            "over the runs; the machine "
            "is shared, so single runs are noisy). Prediction: `costmodel.predict_ddp_comm` with "
            f"alpha {f.alpha * 1e6:.0f} us, beta {f.beta / 1e9:.2f} GB/s{own_fits(cal)}, "
            f"contention x{cal.contention:.2f}, engine {cal.overhead_per_bucket_s * 1e6:.0f} us per bucket, "
            f"completion floor {cal.floor_per_bucket_s * 1e3:.2f} ms per bucket under backward ({f.note}).")
    header = ["world", "cap (MB)", "variant", "buckets", "step (ms)", "step spread (ms)", "tokens/s",
              "efficiency", "busy measured (ms)", "busy spread (ms)", "busy predicted (ms)",
              "predicted / measured", "collectives alone / measured", "exposed measured (ms)",
              "exposed predicted (ms)"]
    return [head, render.table(header, [row(r) for r in results]), *reading(results, cal)]


def row(r: dict) -> list[str]:
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    eff = "oversubscribed" if r["oversubscribed"] else f"{r['efficiency']:.2f}"
    eff = "-" if eff == "nan" else eff  # no world-1 run at this cap
    multi = r["world"] > 1 and r["busy_s"]
    ratio = f"{r['predicted_busy_s'] / r['busy_s']:.2f}" if multi else "-"
    bare = f"{r['alone_s'] / r['busy_s']:.2f}" if multi else "-"
    return [r["world"], f"{r['cap']:g}", r["variant"], r["collectives"], ms(r["step_s"]),
            f"{ms(r['step_spread'][0])}-{ms(r['step_spread'][1])}", f"{r['tokens_per_s']:.0f}", eff,
            ms(r["busy_s"]), f"{ms(r['busy_spread'][0])}-{ms(r['busy_spread'][1])}",
            ms(r["predicted_busy_s"]), ratio, bare, ms(r["exposed_s"]), ms(r["predicted_exposed_s"])]


def own_fits(cal: Calibration) -> str:
    return "".join(f" ({op}: alpha {f.alpha * 1e6:.0f} us, beta {f.beta / 1e9:.2f} GB/s)"
                   for op, f in cal.ops if not op.startswith("zero1_"))  # (the same fits, aliased)


def advice(results, cal: Calibration) -> str:
    """The cost model's best cap for this study's model at world 2, beside the measured best."""
    w2 = [r for r in results if r["world"] == 2 and r["variant"] == "ddp" and r["collectives"]]
    if len(w2) < 2:
        return ""
    fastest = min(w2, key=lambda r: r["step_s"])
    backward = statistics.median((r["step_s"] - r["exposed_s"]) * cal.backward_share for r in w2)
    cap, _ = best_bucket_mb(w2[0]["bytes"] / 4, 4, 2, cal.fabric.alpha, cal.fabric.beta, backward,
                            candidates=sorted(r["cap"] for r in w2), calibration=cal)
    return (f"Bucket advice: `costmodel.best_bucket_mb` with this calibration picks {cap:g} MB for this "
            f"model at world 2; the fastest measured step here is at {fastest['cap']:g} MB "
            f"({fastest['step_s'] * 1e3:.0f} ms).")


def reading(results, cal: Calibration) -> list[str]:
    """What the table says, from its own numbers."""
    w1 = {r["cap"]: r for r in results if r["world"] == 1 and r["variant"] == "ddp"}
    w2 = [r for r in results if r["world"] == 2 and r["busy_s"]]
    if not w2:
        return []
    fit = lambda rs: ", ".join(f"{r['cap']:g} MB" for r in rs  # noqa: E731
                               if abs(r["predicted_busy_s"] / r["busy_s"] - 1) <= 0.2) or "no cap"
    out = ("Reading it. At world 2 the calibrated prediction is within 20% of the measured busy time "
           f"for DDP at {fit([r for r in w2 if r['variant'] == 'ddp'])}")
    for v in sorted({r["variant"] for r in w2} - {"ddp"}):
        out += f"; for {v} at {fit([r for r in w2 if r['variant'] == v])}"
    under = cal.slowdown_for("all_reduce")
    if under is not None:
        out += (f". The model runs each step's buckets in order, each needing its alone time (the "
                f"alpha-beta fit); one that starts while backward still runs on the same cores waits "
                f"{under[1] * 1e3:.2f} ms first and progresses x{under[0]:.2f} slower until backward "
                "ends, at full speed after. Both are fitted by `make calibrate` from the engine itself "
                f"at other caps ({', '.join(f'{c:g}' for c in UNDER_CAPS)} MB): they take in cores shared "
                "with compute, the completion callback and the ranks' skew. The column `collectives "
                "alone` is the same model with nothing beside the collectives: what backward's company "
                "costs. ZeRO-1's reduce-scatter (n in-place reduces on gloo) has its own alone and "
                "under-backward fits; the optimizer overlap is predicted as DDP, though its bucket steps "
                "compete with the buckets still in "
                "flight after backward, which the model leaves out")
    small = min(w1.values(), key=lambda r: r["cap"]) if w1 else None
    if small and small["collectives"] > 1:
        seen = small["busy_s"] / (small["collectives"] - 1) * 1e3
        out += (f". At world 1 nothing crosses a wire, yet a bucket stays in flight "
                f"{seen:.2f} ms at {small['cap']:g} MB (`make calibrate` measures this completion floor "
                f"at {cal.floor_per_bucket_s * 1e3:.2f} ms): the engine learns that a collective finished "
                "through a callback on the communication thread, which has to wait for a core and the "
                "GIL while backward runs")
    out += "."
    if any(r["oversubscribed"] for r in results):
        out += (" Oversubscribed rows (more ranks than cores) time-share cores, which no per-collective "
                "model captures, and their efficiency is not reported.")
    return [out] + ([advice(results, cal)] if advice(results, cal) else [])


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
