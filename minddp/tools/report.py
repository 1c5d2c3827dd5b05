"""Collect every run under a folder into one table and one plot: `minddp report DIR`.

    minddp report multirun/2026-11-30/12-00-00      # a Hydra multirun
    minddp report outputs/sweep-4242                 # a Slurm sweep array
    minddp report outputs                            # any train.py runs
    minddp report multirun/... --wandb               # and one W&B run of job_type=report

A run is a folder with a `metrics.jsonl`; its `run.json` (written by rank 0 at start-up) gives the
world size and the resolved config (`.hydra/config.yaml` is the fallback). Rows are keyed by the
swept keys: those set on a command line (`.hydra/overrides.yaml`) whose values differ between runs,
and the world size (every differing key when no run has overrides); columns: median step time and
tokens/s (after the first fifth of the logged steps: the numbers of the run's summary.json,
minddp.train.metrics.summary), the scaling efficiency against the smallest world size with the same
other keys and scaling mode (1.00 is perfect): strong scaling (fixed global batch) T1 / (n Tn), weak
scaling (fixed batch per rank) T1 / Tn, which one in the column `scaling`; the exposed-communication
fraction, final loss and validation loss, `mfu` where logged, the busy fraction of communication,
and the spread of the ranks' step times with the slowest rank (train.check_every), and the machine's
load (1-minute load average) while it ran. The plot: tokens/s against the world size (or, when it
does not vary, the first numeric swept key, e.g. ddp.bucket_cap_mb), and every run's loss curve.
Writes DIR/report.md and DIR/report.png; with --wandb also a W&B run of job_type report in the
study's group (minddp.tools.wandb_report). A malformed row of a metrics.jsonl (a torn line, hand
edits) is skipped with a one-line warning; a run whose files cannot be read as a run (a run.json
whose world_size is not a whole number, an empty metrics.jsonl, ...) is one line naming it and why,
and the others are reported. Reading the folders and the analysis are minddp/perf/runs.py.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import textwrap
from pathlib import Path

from ..perf.plot import pyplot
from ..perf.runs import BadRun, add_efficiency, read_run, run_folders, series, swept_keys
from ..train.metrics import summary as steady
from ..train.resume.check import flatten
from . import render
from .arguments import existing_dir, tool_parser, writable_out


def load_run(run_dir: Path) -> dict:
    """One run's numbers for the table (raises BadRun for a run that cannot be read)."""
    info = read_run(run_dir)
    rows = info["rows"]
    keys = {"world_size": info["world_size"], **flatten(info["config"])}
    s = steady.summary(rows)  # what summary.json and W&B's summary hold (MFU > 100%: not shown)
    curve = [(r["step"], r["loss"]) for r in rows if steady.number(r.get("loss"))]
    mode = info["identity"].get("scaling") or keys.get("train.scaling") or "strong"
    return {"dir": run_dir, "keys": keys, "set": info["set"], "identity": info["identity"],
            "summary": s, "scaling": mode, "step_s": s.get("step_time_s"),
            "tokens_per_s": s.get("tokens_per_s"), "exposed": s.get("comm/exposed_fraction"),
            "loss": s.get("loss"), "val_loss": s.get("val_loss"),
            "mfu": s.get("mfu"), "steps": rows[-1]["step"], "last": rows[-1], "curve": curve}


HEAD = ["steps", "step (ms)", "tokens/s", "efficiency", "exposed comm", "loss", "val loss", "mfu", "scaling",
        "comm busy", "rank step min/median/max (ms)", "slowest rank", "load", "status"]


def table_rows(runs: list[dict], swept: list[str]) -> tuple[list[str], list[list]]:
    """The table's header and rows (report.md's, and the W&B report run's wandb.Table)."""
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    rows = []
    for r in runs:
        s = r["summary"]
        spread = [s.get(f"rank/step_time_{k}_s") for k in ("min", "median", "max")]
        rows.append([r["keys"].get(k) for k in swept] + [
            r["steps"], fmt(r["step_s"] and r["step_s"] * 1e3, ".1f"), fmt(r["tokens_per_s"], ".0f"),
            fmt(r["efficiency"], ".2f"), fmt(r["exposed"], ".1%"), fmt(r["loss"], ".4f"),
            fmt(r["val_loss"], ".4f"), fmt(r["mfu"], ".2%"), r["scaling"],
            fmt(s.get("comm/busy_fraction"), ".1%"),
            "-" if None in spread else "/".join(f"{v * 1e3:.1f}" for v in spread),
            fmt(s.get("rank/slowest"), "d"), fmt(s.get("machine/load_1min"), ".1f"), ended(s)])
    return [*swept, *HEAD], rows


def ended(s: dict) -> str:
    """`ok`, or `non-finite` (a run that stopped on NaN/inf), with its skipped steps."""
    skipped = s.get("skipped_steps")
    return s.get("status", "ok") + (f" ({skipped} skipped)" if skipped else "")


def modes_note(runs: list[dict]) -> str:
    modes = sorted({r["scaling"] for r in runs})
    said = {"strong": "strong scaling (fixed global batch): T1 / (n Tn)",
            "weak": "weak scaling (fixed batch per rank): T1 / Tn"}
    return "Efficiency: " + "; ".join(said[m] for m in modes if m in said) + ", against the smallest world."


def label(r: dict, keys: list[str], folder: Path) -> str:
    text = ", ".join(f"{k}={r['keys'].get(k)}" for k in keys) or str(r["dir"].relative_to(folder) or ".")
    return textwrap.fill(text, 48)  # a long label wraps inside the legend, not past the figure


def x_key(runs: list[dict], swept: list[str]) -> str:
    """What the throughput is plotted against: the world size when it varies, else the first
    swept key whose values are all numbers (a bucket-cap sweep: ddp.bucket_cap_mb)."""
    numeric = [k for k in swept if all(steady.number(r["keys"].get(k)) for r in runs)]
    return "world_size" if "world_size" in swept or not numeric else numeric[0]


def plot(runs: list[dict], swept: list[str], png: Path, folder: Path = Path(".")) -> None:
    fig = figure(runs, swept, folder)
    fig.savefig(png, dpi=110)
    pyplot().close(fig)


def figure(runs: list[dict], swept: list[str], folder: Path = Path(".")):
    """Left: tokens/s against the swept key (x_key), a line per value of the other swept keys.
    Right: every run's loss curve. Legends inside their axes; constrained layout keeps titles whole."""
    fig, (ax, ax_loss) = pyplot().subplots(1, 2, figsize=(11, 4.4), layout="constrained")
    x = x_key(runs, swept)
    for name, rs in series([r for r in runs if r["tokens_per_s"] is not None], swept, x).items():
        ax.plot([r["keys"][x] for r in rs], [r["tokens_per_s"] for r in rs], "o-",
                label=textwrap.fill(name, 48))
    ax.set(xlabel=x.replace("_", " ") if x == "world_size" else x, ylabel="tokens / s",
           title="throughput (median after warm-up)")
    if x == "world_size":
        ax.xaxis.get_major_locator().set_params(integer=True)
    for r in runs:
        if r["curve"]:
            steps, losses = zip(*r["curve"])
            ax_loss.plot(steps, losses, label=label(r, swept, folder))
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss per run")
    for a in (ax, ax_loss):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7, ncol=1 + len(a.get_lines()) // 12)
    return fig


def load_note(runs: list[dict]) -> str:
    """The machine's load while the runs trained (a shared machine slows runs unevenly)."""
    loads = sorted(r["summary"]["machine/load_1min"] for r in runs if "machine/load_1min" in r["summary"])
    if not loads:
        return ""
    return (f" Machine load (1-minute load average, median over each run's steady rows; {os.cpu_count()} "
            f"cores here): median {statistics.median(loads):.1f}, range {loads[0]:.1f}-{loads[-1]:.1f}; "
            "other work on a shared machine slows runs unevenly: the column `load` says which.")


def in_order(value) -> tuple:
    """A sort key: numbers by value (1, 5, 25, 100, not "1", "100", "25", "5"), then the rest."""
    return (0, value, "") if steady.number(value) else (1, 0, json.dumps(value, sort_keys=True))


def load_runs(folder: Path) -> list[dict]:
    """Every run under the folder; one that cannot be read is one line naming it and why."""
    runs = []
    for run_dir in run_folders(folder):
        try:
            runs.append(load_run(run_dir))
        except BadRun as e:
            print(f"minddp report: warning: skipped {e}", file=sys.stderr)
    return runs


def report(folder, out=None, to_wandb: bool = False) -> str:
    folder = Path(folder)
    runs = load_runs(folder)
    if not runs:  # bad input: exit 2, as every tool's
        print(f"minddp report: error: no run (a folder with a metrics.jsonl that has rows) under {folder}",
              file=sys.stderr)
        raise SystemExit(2)
    swept = swept_keys(runs)
    runs.sort(key=lambda r: [in_order(r["keys"].get(k)) for k in swept])
    add_efficiency(runs, swept)
    text = (f"{len(runs)} runs under `{folder}`; swept: {', '.join(swept) or 'nothing'}. "
            f"{modes_note(runs)}{load_note(runs)}\n\n"
            + render.markdown([render.table(*table_rows(runs, swept))]) + "\n")
    out = Path(out) if out else folder / "report"
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(text)
    plot(runs, swept, Path(f"{out}.png"), folder)
    if to_wandb:
        from . import wandb_report

        wandb_report.log(folder, runs, swept, *table_rows(runs, swept), Path(f"{out}.png"))
    return text


def main(argv=None) -> None:
    ap = tool_parser("report", __doc__)
    ap.add_argument("folder", type=existing_dir)
    ap.add_argument("--out", type=writable_out,
                    help="output prefix (default FOLDER/report -> report.md, report.png)")
    ap.add_argument("--wandb", action="store_true",
                    help="also log a W&B run of job_type=report into the study's group (wandb.mode auto)")
    args = ap.parse_args(argv)
    print(report(args.folder, args.out, to_wandb=args.wandb))
    out = args.out or str(Path(args.folder) / "report")
    print(f"wrote {out}.md and {out}.png")


if __name__ == "__main__":
    main()
