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
lands in DIR/wandb/, and one command uploads the whole folder (`upload_command`).
"""

from __future__ import annotations

from pathlib import Path

from ..train.metrics.tracking import resolve_wandb_mode

ROOT = Path(__file__).resolve().parents[2]


def study_group(runs: list[dict], folder: Path) -> tuple[str, str]:
    """(project, group): the runs' own W&B project and group where they share one, else the folder's name."""
    groups = {r["keys"].get("wandb.group") for r in runs}
    projects = {r["keys"].get("wandb.project") for r in runs} - {None}
    group = groups.pop() if len(groups) == 1 and None not in groups else Path(folder).resolve().name
    return (projects.pop() if len(projects) == 1 else "minddp"), group


def series(runs: list[dict], swept: list[str]) -> dict[str, list[dict]]:
    """The runs by the values of the swept keys other than the world size, each by world size."""
    others = [k for k in swept if k != "world_size"]
    out: dict[str, list[dict]] = {}
    for r in runs:
        name = ", ".join(f"{k}={r['keys'].get(k)}" for k in others) or "runs"
        out.setdefault(name, []).append(r)
    return {k: sorted(v, key=lambda r: r["keys"]["world_size"]) for k, v in out.items()}


def predicted_busy(r: dict, cal) -> float | None:
    """The cost model's busy time for this run's buckets (equal shares of its measured bytes)."""
    from ..perf.costmodel import predict_ddp_comm

    if r["step_s"] is None:
        return None
    count, nbytes = r["last"].get("comm/collectives") or 0, r["last"].get("comm/bytes") or 0
    accum = r["identity"].get("accumulation") or 1
    backward = (r["step_s"] - (r["summary"].get("comm/exposed_wait_s") or 0)) / accum * cal.backward_share
    op = "reduce_scatter" if r["identity"].get("variant") == "zero1" else "all_reduce"
    buckets = [nbytes / count] * count if count else []
    return predict_ddp_comm(buckets, r["keys"]["world_size"], cal, backward, op=op)["busy_s"]


def calibration():
    from ..perf.costmodel import PRESETS, Calibration

    path = ROOT / "docs" / "calibration.json"
    return Calibration.load(path) if path.exists() else Calibration(PRESETS["this-machine-gloo"])


def lines(runs: list[dict], swept: list[str]) -> dict[str, tuple[list, list, list[str]]]:
    """Plot name -> (xs per line, ys per line, line names): what the W&B charts draw."""
    cal, out = calibration(), {}
    groups = series(runs, swept)

    def add(plot, name, rs, value):
        pts = [(r["keys"]["world_size"], value(r)) for r in rs]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            xs, ys, names = out.setdefault(plot, ([], [], []))
            xs.append([x for x, _ in pts]), ys.append([y for _, y in pts]), names.append(name)

    for name, rs in groups.items():
        base = next((r for r in rs if r["tokens_per_s"]), None)
        add("tokens_per_s", name, rs, lambda r: r["tokens_per_s"])
        if base:  # linear from the smallest world's throughput
            per_rank = base["tokens_per_s"] / base["keys"]["world_size"]
            add("tokens_per_s", f"ideal, {name}", rs, lambda r, p=per_rank: p * r["keys"]["world_size"])
        add("efficiency", name, rs, lambda r: r["efficiency"])
        add("comm", f"busy, {name}", rs, lambda r: r["summary"].get("comm/busy_fraction"))
        add("comm", f"exposed, {name}", rs, lambda r: r["exposed"])
        add("predicted_busy", f"measured, {name}", rs, lambda r: r["summary"].get("comm/busy_s"))
        add("predicted_busy", f"cost model, {name}", rs, lambda r: predicted_busy(r, cal))
        for k in ("min", "median", "max"):
            add("rank_spread", f"{k}, {name}", rs, lambda r, k=k: r["summary"].get(f"rank/step_time_{k}_s"))
    return out


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
    run = wandb.init(project=project, group=group, job_type="report", name=f"report-{group}", mode=mode,
                     dir=str(folder), tags=["report", *sorted({r["scaling"] for r in runs})],
                     config={"folder": str(folder), "runs": len(runs), "swept": swept,
                             "scaling": sorted({r["scaling"] for r in runs})},
                     settings=wandb.Settings(quiet=True, silent=True))  # our own line says where
    logged = {"report/table": wandb.Table(columns=head, data=[[str(c) for c in row] for row in rows])}
    for key, (xs, ys, names) in lines(runs, swept).items():
        title, ylabel = TITLES[key]
        logged[f"report/{key}"] = wandb.plot.line_series(xs=xs, ys=ys, keys=names, title=title,
                                                         xname="world size")
    if png.exists():
        logged["report/figure"] = wandb.Image(str(png), caption=f"minddp report {folder}")
    run.log(logged)
    run.finish()
    print(f"W&B report run ({mode}): group {group}, job_type report"
          + (f"; upload the study: {upload_command(folder)}" if mode == "offline" else ""))
    return mode


def upload_command(folder) -> str:
    """One command that uploads every offline W&B run under the folder: each run keeps its own in
    <run dir>/wandb/offline-run-*, at any depth (`wandb sync` of a wandb/ folder takes only its
    latest run; the parts of a resumed run go up in the order they started)."""
    return f"wandb sync $(find {folder} -type d -name 'offline-run-*')"
