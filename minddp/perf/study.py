"""The scaling study's runs and analysis (`minddp scaling` is its command line): each run a real
`torchrun train.py` (a subprocess: nothing of the trainer is imported), read back from its
metrics.jsonl; repeats combined; the calibrated cost model's busy and exposed time beside each.

Steps after the warm-up give the median step time, throughput, the engine's communication busy
time (at least one bucket in flight) and exposed wait. Efficiency: strong (the global batch
fixed) T1 / (n Tn); weak (each rank's batch fixed) T1 / Tn; ideal is 1 in both.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from ..engine.buckets import TensorSpec
from .calibration import UNDER_CAPS
from .costmodel import Calibration, predicted_comm
from .costmodel import load_calibration as calibration  # noqa: F401  (the study's name for it)
from .jobs import ROOT, launch, run_job
from .runs import BadRun, read_run
from .workload import GPT_PRESETS, STUDY, STUDY_BATCH, overrides

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
    args = [f"train.max_steps={steps}", "train.eval_every=0", "train.ckpt_every=0", "train.ckpt_final=false",
            f"ddp.bucket_cap_mb={cap}", f"wandb.group={group}", *extra]
    cmd = launch(world, str(ROOT / "train.py"), torchrun=False)
    p = run_job(cmd + args, {"MINDDP_RUN_DIR": str(run_dir)}, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"minddp.tools.scaling: {run_dir.name} failed (exit {p.returncode}):\n"
                         f"{p.stderr[-4000:]}")


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
            if args.reuse and not (run_dir / "metrics.jsonl").exists() and not run_dir.exists():
                continue  # an earlier study without this variant or repeat
            if not args.reuse:
                print(f"repeat {k + 1}/{args.repeats}: {v}, world {w}, bucket cap {c:g} MB ...", flush=True)
                mode = [f"train.scaling={args.mode}", f"wandb.repeat={k}"]  # a W&B name per repeat
                run(run_dir, w, c, args.steps, group, MODEL + VARIANTS[v] + mode + args.overrides)
                # the machine's load as the run ended: others share these cores
                (run_dir / "load.json").write_text(json.dumps({"loadavg_1min": os.getloadavg()[0]}))
            try:
                summary = summarize(run_dir, args.warmup)
            except BadRun as e:  # named, and the study goes on with the others
                print(f"minddp scaling: warning: skipped {e}", file=sys.stderr)
                continue
            runs.setdefault((v, w, c), []).append(summary)
    if not runs:
        raise SystemExit(f"minddp scaling: error: no run of the study under {out_dir} could be read")
    return runs


def summarize(run_dir: Path, warmup: int) -> dict:
    """The medians of a run's rows after the warm-up (runs.read_run reads the folder; BadRun
    where the folder, or what the warm-up leaves of it, is no run to measure)."""
    every = read_run(run_dir, "minddp scaling")["rows"]
    rows = every[warmup:]
    if not rows:
        raise BadRun(f"{run_dir}: --warmup {warmup} leaves none of its {len(every)} rows; give a smaller "
                     "--warmup")

    def med(key):
        values = [r[key] for r in rows if type(r.get(key)) in (int, float)]
        if not values:
            raise BadRun(f"{run_dir}: no row after the warm-up has a number for {key}")
        return statistics.median(values)

    last = rows[-1]
    return {"load": _load_average(run_dir), "step_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"),
            "busy_s": med("comm/busy_s"), "exposed_s": med("comm/exposed_wait_s"),
            "bytes": last.get("comm/bytes", 0), "collectives": last.get("comm/collectives", 0)}


def _load_average(run_dir: Path) -> float | None:
    """The machine's load as the run ended (load.json), where it was recorded and is readable."""
    try:
        load = json.loads((run_dir / "load.json").read_text())["loadavg_1min"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return load if isinstance(load, (int, float)) else None


def combine(runs: list[dict]) -> dict:
    """Several repeats of one configuration: medians, and the spread (min, max) of step and busy."""
    keys = ("step_s", "tokens_per_s", "busy_s", "exposed_s")
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    return {**out, "bytes": runs[0]["bytes"], "collectives": runs[0]["collectives"], "repeats": len(runs),
            "step_spread": (min(r["step_s"] for r in runs), max(r["step_s"] for r in runs)),
            "busy_spread": (min(r["busy_s"] for r in runs), max(r["busy_s"] for r in runs))}


def accumulation(world: int, mode: str = "strong") -> int:
    """Micro-steps per step in the study (global batch 8, micro-batch 2; weak: 8 per rank)."""
    return max(1, STUDY_BATCH[0] // (STUDY_BATCH[1] * (1 if mode == "weak" else world)))


def study_buckets(cap: float, count: int, nbytes: float, specs: list[TensorSpec]) -> list[float]:
    """The engine's bucket sizes (launch order: reversed registration) for these parameters at
    `cap`, by the engine's own planner; equal shares of the measured bytes where the run had
    another number of buckets."""
    from .costmodel import planned_bytes

    planned = planned_bytes(specs, cap, list(reversed(range(len(specs)))))
    if len(planned) != count:
        return [nbytes / count] * count if count else []
    return planned


def analyse(runs: dict, cal: Calibration, mode: str = "strong", specs: list[TensorSpec] = ()) -> list[dict]:
    """One row per (variant, world, cap): the repeats combined, the prediction for the run's own
    buckets (`specs`: the study GPT's parameters), the efficiency against world 1 at that cap."""
    cores = len(os.sched_getaffinity(0))
    results = []
    for (v, w, c), rs in sorted(runs.items(), key=lambda kv: (kv[0][2], list(VARIANTS).index(kv[0][0]),
                                                             kv[0][1])):
        s = combine(rs)
        buckets = study_buckets(c, s["collectives"], s["bytes"], list(specs))
        p = predicted_comm(buckets, w, cal, s["step_s"], s["exposed_s"], accumulation(w, mode), v)
        results.append({"variant": v, "world": w, "cap": c, **s, "predicted_busy_s": p["busy_s"],
                        "predicted_exposed_s": p["exposed_s"], "alone_s": p["alone_s"]})
    base = {r["cap"]: r["step_s"] for r in results if r["world"] == 1 and r["variant"] == "ddp"}
    for r in results:
        r["oversubscribed"] = r["world"] * 1 > cores  # one thread per rank
        n = 1 if mode == "weak" else r["world"]  # weak: T1 / Tn; strong: T1 / (n Tn)
        r["efficiency"] = base[r["cap"]] / (n * r["step_s"]) if r["cap"] in base else float("nan")
    return results


def loads(runs: dict) -> list[float]:
    """The machine's 1-minute load average as each run ended, sorted (runs that recorded it)."""
    return sorted(r["load"] for rs in runs.values() for r in rs if r.get("load") is not None)


def within(results: list[dict], variant: str, tolerance: float = 0.2) -> list[float]:
    """The caps at world 2 where the prediction is within `tolerance` of the measured busy time."""
    return [r["cap"] for r in results if r["world"] == 2 and r["busy_s"] and r["variant"] == variant
            and abs(r["predicted_busy_s"] / r["busy_s"] - 1) <= tolerance]


def advised_cap(results: list[dict], cal: Calibration) -> tuple[float, dict] | None:
    """(the cost model's best cap for the study's model at world 2 among the caps run, the
    fastest measured DDP row there); None with fewer than two such rows."""
    from .costmodel import best_bucket_mb

    w2 = [r for r in results if r["world"] == 2 and r["variant"] == "ddp" and r["collectives"]]
    if len(w2) < 2:
        return None
    backward = statistics.median((r["step_s"] - r["exposed_s"]) * cal.backward_share for r in w2)
    cap, _ = best_bucket_mb(w2[0]["bytes"] / 4, 4, 2, cal.fabric.alpha, cal.fabric.beta, backward,
                            candidates=sorted(r["cap"] for r in w2), calibration=cal)
    return cap, min(w2, key=lambda r: r["step_s"])


def reading(results, cal: Calibration) -> list[str]:
    """What the table says, from its own numbers."""
    w1 = {r["cap"]: r for r in results if r["world"] == 1 and r["variant"] == "ddp"}
    w2 = [r for r in results if r["world"] == 2 and r["busy_s"]]
    if not w2:
        return []
    fit = lambda v: ", ".join(f"{c:g} MB" for c in within(results, v)) or "no cap"  # noqa: E731
    out = ("Reading it. At world 2 the calibrated prediction is within 20% of the measured busy time "
           f"for DDP at {fit('ddp')}")
    for v in sorted({r["variant"] for r in w2} - {"ddp"}):
        out += f"; for {v} at {fit(v)}"
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
    advice = advised_cap(results, cal)
    if advice:
        cap, fastest = advice
        out = [out, f"Bucket advice: `costmodel.best_bucket_mb` with this calibration picks {cap:g} MB for "
                    f"this model at world 2; the fastest measured step here is at {fastest['cap']:g} MB "
                    f"({fastest['step_s'] * 1e3:.0f} ms)."]
    return out if advice else [out]
