"""The study as one W&B run: `minddp report DIR --wandb` (and the end of `minddp scaling` and
`make sweep`) logs a run of job_type=report into the study's group, beside its runs.

What it holds: the report's table (`report/table`, a wandb.Table), native line plots against
the world size, one line per value of the other swept keys (bucket cap, variant, ...):
`report/tokens_per_s` (with the ideal: the smallest world's throughput x n / n0),
`report/efficiency`, `report/comm` (busy and exposed fractions of the step),
`report/predicted_busy` (measured busy time beside the calibrated cost model's,
minddp.perf.costmodel.predict_ddp_comm) and `report/rank_spread` (the ranks' min / median / max
step time); and the report's PNG as `report/figure` (a wandb.Image). W&B's mode is the runs'
`wandb.mode` where they agree, else auto (online with an API key, else offline:
minddp.train.metrics.tracking.resolve_wandb_mode); disabled runs get no report run; the offline run
lands in DIR/wandb/, and one command uploads the whole folder (`upload_command`). The lines
are minddp/perf/runs.py's.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from ..perf.runs import lines, study_group
from ..train.metrics.tracking import resolve_wandb_mode
from ..train.metrics.wandb_run import INIT_TIMEOUT_S, no_online_run

TITLES = {"tokens_per_s": ("tokens/s vs world size (ideal: linear from the smallest world)", "tokens / s"),
          "efficiency": ("scaling efficiency vs world size", "efficiency"),
          "comm": ("communication busy and exposed, fraction of the step", "fraction of the step"),
          "predicted_busy": ("communication busy time: measured vs the cost model", "seconds per step"),
          "rank_spread": ("the ranks' step times (min / median / max)", "seconds per step")}


def log(folder, runs: list[dict], swept: list[str], head: list[str], rows: list[list], png: Path) -> str:
    """Log the report run; returns its mode (online / offline / disabled)."""
    import wandb

    project, group = study_group(runs, folder)
    modes = {r["keys"].get("wandb.mode") for r in runs}  # the runs' own wandb.mode, where they agree
    mode = resolve_wandb_mode(modes.pop() if len(modes) == 1 and None not in modes else "auto")
    if mode == "disabled":
        print("W&B is disabled for these runs: no report run")
        return mode
    # one report run per study: the same id every time (the end of `minddp scaling`, then `minddp report
    # DIR --wandb` again), so W&B updates that run rather than adding a second one to the group
    run, mode = start(folder, dict(
        project=project, group=group, job_type="report", name=f"report-{group}",
        id=re.sub(r"[^\w-]", "-", f"report-{group}")[:64], resume="allow",
        dir=str(folder), tags=["report", *sorted({r["scaling"] for r in runs})],
        config={"folder": str(folder), "runs": len(runs), "swept": swept,
                "scaling": sorted({r["scaling"] for r in runs})},
        settings=wandb.Settings(quiet=True, silent=True, init_timeout=INIT_TIMEOUT_S)), mode)
    logged = {"report/table": wandb.Table(columns=head, data=[[str(c) for c in row] for row in rows])}
    for key, (xs, ys, names) in lines(runs, swept).items():
        logged[f"report/{key}"] = wandb.plot.line_series(xs=xs, ys=ys, keys=names, title=TITLES[key][0],
                                                         xname="world size")
    if png.exists():
        logged["report/figure"] = wandb.Image(str(png), caption=f"minddp report {folder}")
    run.log(logged)
    run.finish()
    print(f"W&B report run ({mode}): group {group}, job_type report"
          + (f"; upload the study: {upload_command(folder)}" if mode == "offline" else ""))
    return mode


def start(folder, kwargs: dict, mode: str):
    """(run, mode): wandb.init; an online run that a server answering the probe does not start
    within wandb.init_timeout's default starts offline instead, in one line (as a training run's)."""
    import wandb

    started = time.monotonic()
    try:
        return wandb.init(mode=mode, **kwargs), mode
    except Exception as e:  # noqa: BLE001 - wandb's CommError on a timeout, and its other errors
        if mode != "online":
            raise
        what = no_online_run(e, time.monotonic() - started, INIT_TIMEOUT_S, f"{INIT_TIMEOUT_S:g} s")
        print(f"W&B: {what} (the report run); logging it offline instead; upload later with "
              f"{upload_command(folder)}")
        wandb.teardown()  # W&B's service still holds the run's id for the online attempt
        return wandb.init(mode="offline", **kwargs), "offline"


def upload_command(folder) -> str:
    """One command that uploads every offline W&B run under the folder: each run keeps its own in
    <run dir>/wandb/offline-run-*, at any depth (`wandb sync` of a wandb/ folder takes only its
    latest run; the parts of a resumed run go up in the order they started)."""
    return f"wandb sync $(find {folder} -type d -name 'offline-run-*')"
