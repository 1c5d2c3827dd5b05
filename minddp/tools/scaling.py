"""Scaling study: the trainer over world sizes and bucket caps, same global batch, with the
calibrated cost model's prediction beside every measurement.

    minddp scaling [--worlds 1,2,4] [--caps 1,5,25,100] [--steps 16] [--out PREFIX]
    minddp scaling --repeats 3 --variants auto      # make scaling: + ZeRO-1 (+ overlap) at world 2
    minddp scaling --mode weak                      # per-rank batch fixed: the global batch grows

Each run is a real `torchrun train.py` with its own run directory in the study's folder
(scaling-<time>/ in the folder of --out, else in ./outputs/), all of them in one W&B group.
From each run's metrics.jsonl (steps after the warm-up) it takes the
median step time, throughput, the engine's communication busy time (at least one bucket in
flight) and exposed wait, computes the scaling efficiency (--mode strong, the default: the
global batch is fixed, T1 / (n * Tn); --mode weak, train.scaling=weak: each rank's batch is
fixed, T1 / Tn; ideal is 1 in both), and predicts busy and exposed time with
`costmodel.predict_ddp_comm` and the calibration of `make calibrate` (alpha, beta, the
contention factor, the engine's per-bucket cost and the per-bucket completion floor, measured
on this machine). With --repeats each configuration runs that often, the order rotated per
repeat, and the table gives medians and spreads. Rows whose
world size x threads exceed the machine's cores are marked oversubscribed: ranks time-share
cores there, so efficiency says nothing about the method. Writes <out>.md and <out>.png (by
default scaling.{md,png} in the study's own folder, beside its runs; `make docs` writes docs/),
and at the end logs the study's W&B report run into its group (`minddp report --wandb`; each
run's W&B name holds its variant and repeat, wandb.repeat) and prints the one command that
uploads every offline run of the study. The runs and the analysis are minddp/perf/study.py.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from pathlib import Path

import torch

from ..engine.buckets import TensorSpec
from ..model.gpt import GPT, GPTConfig
from ..perf import study
from ..perf.costmodel import DEFAULT_CALIBRATION, PRESETS
from ..perf.plot import pyplot
from ..perf.study import STUDY_GPT
from ..perf.workload import STUDY_BATCH
from . import render
from .arguments import (
    calibration_file,
    choice_list,
    existing_dir,
    float_list,
    int_list,
    nonnegative_int,
    positive_int,
    tool_parser,
    writable_out,
)


@functools.cache
def study_params() -> tuple[torch.Tensor, ...]:
    """The study GPT's trainable parameters on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return tuple(p for p in GPT(GPTConfig(**STUDY_GPT)).parameters() if p.requires_grad)


def main(argv=None) -> None:
    args = parse(argv)
    worlds, caps, variants = args.worlds, args.caps, args.variants
    group = Path(args.reuse).name if args.reuse else f"scaling-{time.strftime('%Y%m%d-%H%M%S')}"
    # everything the study writes goes under the folder the user named: --out's, else ./outputs
    home = Path(args.out).parent if args.out else Path("outputs")
    out_dir = Path(args.reuse) if args.reuse else (home / group).resolve()
    # a --calibration given must exist (a misspelled path fell back to the preset unseen); the
    # repository's own file is the default unless --preset is given
    cal = study.calibration(args.calibration or (None if args.preset else DEFAULT_CALIBRATION),
                            args.preset or "this-machine-gloo")
    runs = study.collect(args, variants, worlds, caps, out_dir, group)
    results = study.analyse(runs, cal, args.mode, [TensorSpec.of(p) for p in study_params()])
    blocks = report(args, group, cal, len(os.sched_getaffinity(0)), results) + load_note(study.loads(runs))
    print(render.markdown(blocks))
    out = args.out or str(out_dir / "scaling")  # never the repository's docs/ unless asked (make docs)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    render.write(out + ".md", blocks, {"results": results})
    plot([r for r in results if r["variant"] == "ddp"], worlds, caps, out + ".png", args.mode)
    if not args.reuse:  # the study as one W&B run, in the runs' group; the upload command once
        from .report import report as folder_report

        folder_report(out_dir, to_wandb=True)
    print(f"wrote {out}.md and {out}.png; runs in {out_dir}")


def parse(argv=None) -> argparse.Namespace:
    ap = tool_parser("scaling", __doc__)
    ap.add_argument("--worlds", type=int_list(), default="1,2,4")
    ap.add_argument("--caps", type=float_list(), default="1,5,25,100")
    ap.add_argument("--steps", type=positive_int, default=16)
    ap.add_argument("--warmup", type=nonnegative_int, default=4, help="steps left out, fewer than --steps")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="runs of each configuration, rotated order")
    ap.add_argument("--mode", choices=("strong", "weak"), default="strong",
                    help="strong: the global batch fixed; weak: each rank's batch fixed (train.scaling)")
    ap.add_argument("--variants", type=choice_list(study.VARIANTS, every="auto"), default="ddp",
                    help="ddp, zero1, overlap (at world 2, beside DDP), or auto (those the trainer has)")
    ap.add_argument("--out", type=writable_out,
                    help="prefix of the .md and .png (default: <the study's folder>/scaling)")
    ap.add_argument("--calibration", type=calibration_file,
                    help="from `make calibrate` (default: docs/calibration.json, else --preset)")
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="instead of a calibration file (default where there is none: this-machine-gloo)")
    ap.add_argument("--reuse", metavar="DIR", type=existing_dir,
                    help="re-read the runs of an earlier study instead of running")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after the study's model)")
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves none of --steps {args.steps} to measure")
    if problem := override_problem(args.overrides):
        ap.error(problem)
    return args


def override_problem(overrides: list[str]) -> str | None:
    """Hydra's refusal of the study's overrides (an unknown key, a wrong type), before any run:
    otherwise the first run failed with train.py's exit code 1."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ..train.config import register

    register()
    try:
        with initialize_config_dir(config_dir=str(study.ROOT / "conf"), version_base="1.3"):
            compose("config", overrides=[*study.MODEL, *overrides])
    except (HydraException, OmegaConfBaseException) as e:
        cause = str(e.__cause__).splitlines()[0] if e.__cause__ else ""
        return f"overrides {' '.join(overrides)}: {str(e).splitlines()[0]}{f' ({cause})' if cause else ''}"
    return None


def load_note(loads: list[float]) -> list[str]:
    if not loads:
        return []
    return [f"Machine load (1-minute load average as each run ended, {len(os.sched_getaffinity(0))} "
            f"cores): median {statistics.median(loads):.1f}, range {loads[0]:.1f}-{loads[-1]:.1f}. Other "
            "work on the shared machine slows communication and compute unevenly: that is what the "
            "spreads show."]


def report(args, group, cal, cores, results) -> list:
    """The report's blocks (render.markdown)."""
    f, gpt, (batch, _) = cal.fabric, STUDY_GPT, STUDY_BATCH
    worlds, caps = ",".join(map(str, args.worlds)), ",".join(f"{c:g}" for c in args.caps)
    cmd = (f"minddp scaling --worlds {worlds} --caps {caps} "
           f"--repeats {args.repeats} --variants {','.join(args.variants)} --steps {args.steps} "
           f"--warmup {args.warmup}")
    if args.reuse:  # the runs of an earlier study, predicted again (e.g. after make calibrate)
        cmd += f" --reuse {Path(args.reuse).name}"
    weak = args.mode == "weak"
    cmd += " --mode weak" if weak else ""
    size = f" ({sum(p.numel() for p in study_params()) / 1e6:.1f}M parameters)"
    fits = "".join(f" ({op}: alpha {x.alpha * 1e6:.0f} us, beta {x.beta / 1e9:.2f} GB/s)"
                   for op, x in cal.ops if not op.startswith("zero1_"))  # (the same fits, aliased)
    head = (f"Command: `{cmd}` (`make scaling` is `minddp scaling --repeats 3 --variants auto`); "
            f"W&B group `{group}`; GPT {gpt['n_layer']} layers x {gpt['n_embd']}{size}, "
            f"{'batch per rank' if weak else 'global batch'} {batch} x {gpt['block_size']} tokens, "
            f"{'weak scaling: efficiency T1 / Tn' if weak else 'strong scaling: efficiency T1 / (n Tn)'}, "
            f"1 thread per rank on {cores} cores; "
            f"{args.repeats} run(s) of each configuration in rotated order, medians (spread: min-max "
            "over the runs; the machine "
            "is shared, so single runs are noisy). Prediction: `costmodel.predict_ddp_comm` with "
            f"alpha {f.alpha * 1e6:.0f} us, beta {f.beta / 1e9:.2f} GB/s{fits}, "
            f"contention x{cal.contention:.2f}, engine {cal.overhead_per_bucket_s * 1e6:.0f} us per bucket, "
            f"completion floor {cal.floor_per_bucket_s * 1e3:.2f} ms per bucket under backward ({f.note}).")
    header = ["world", "cap (MB)", "variant", "buckets", "step (ms)", "step spread (ms)", "tokens/s",
              "efficiency", "busy measured (ms)", "busy spread (ms)", "busy predicted (ms)",
              "predicted / measured", "collectives alone / measured", "exposed measured (ms)",
              "exposed predicted (ms)"]
    return [head, render.table(header, [row(r) for r in results]), *study.reading(results, cal)]


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


def plot(results, worlds, caps, png, mode: str = "strong") -> None:
    """Throughput, and busy time measured (solid) beside the model (dashed) in one colour per cap;
    caps in numeric order."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, cap in enumerate(sorted(caps)):
        rs, colour = [r for r in results if r["cap"] == cap], f"C{i}"
        worlds_of = [r["world"] for r in rs]
        a.plot(worlds_of, [r["tokens_per_s"] for r in rs], "o-", color=colour, label=f"cap {cap:g} MB")
        b.plot(worlds_of, [r["busy_s"] * 1e3 for r in rs], "o-", color=colour, label=f"cap {cap:g} MB")
        b.plot(worlds_of, [r["predicted_busy_s"] * 1e3 for r in rs], "x--", color=colour)
    batch = "fixed batch per rank" if mode == "weak" else "fixed global batch"
    a.set(xlabel="world size", ylabel="tokens / s", xticks=worlds,
          title=f"throughput ({mode} scaling, {batch})")
    b.set(xlabel="world size", ylabel="ms per step", xticks=worlds,
          title="gradient communication busy time\nmeasured (solid) vs calibrated model (dashed)")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
