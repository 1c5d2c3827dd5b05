"""Collect every run under a folder into one table and one plot: `minddp report DIR`.

    minddp report multirun/2026-11-30/12-00-00      # a Hydra multirun
    minddp report outputs/sweep-4242                 # a Slurm sweep array
    minddp report outputs                            # any train.py runs

A run is a folder with a `metrics.jsonl`; its `run.json` (written by rank 0 at start-up)
gives the world size and the resolved config (`.hydra/config.yaml` is the fallback). Rows
are keyed by the swept keys: those set on a command line (`.hydra/overrides.yaml`) whose
values differ between runs, and the world size (every differing key when no run has
overrides); columns:
median step time and tokens/s (after the first fifth of the logged steps), strong-scaling
efficiency against the smallest world size with the same other keys (the global batch is
fixed, so 1.00 is perfect), the exposed-communication fraction, final loss and validation
loss, and `mfu` where logged. The plot: tokens/s per world size, and every run's loss curve.
Offline: no W&B server is involved. Writes DIR/report.md and DIR/report.png. A malformed
row of a metrics.jsonl (a torn line, hand edits) is skipped with a one-line warning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from pathlib import Path

import yaml

from ..train.resume_check import flatten
from . import render
from .cli import pyplot

IGNORED = ("wandb.", "hydra.", "data.cache_dir", "train.resume", "train.stop_at_step")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl that a run wrote: a dict with an integer step. Anything
    else is skipped, and said in one line."""
    rows, bad = [], []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
        else:
            bad.append(n)
    if bad:
        print(f"minddp report: warning: {path}: skipped {len(bad)} malformed row(s) (line "
              f"{', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''})", file=sys.stderr)
    return rows


def read_info(run_dir: Path) -> dict:
    """World size and config: run.json, else .hydra/config.yaml (world 1), else nothing."""
    info_path, hydra = run_dir / "run.json", run_dir / ".hydra" / "config.yaml"
    try:
        if info_path.exists():
            info = json.loads(info_path.read_text())
            if isinstance(info, dict) and isinstance(info.get("config", {}), dict):
                return {"world_size": info.get("world_size", 1), "config": info.get("config", {})}
        elif hydra.exists():
            return {"world_size": 1, "config": yaml.safe_load(hydra.read_text()) or {}}
    except (ValueError, yaml.YAMLError, UnicodeDecodeError):
        pass
    if info_path.exists() or hydra.exists():
        print(f"minddp report: warning: {run_dir}: unreadable run.json/.hydra/config.yaml; "
              "its config is left blank", file=sys.stderr)
    return {"world_size": 1, "config": {}}


def set_keys(run_dir: Path) -> set[str]:
    """The keys set on this run's command line (`model=mlp` sets model.name)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        items = yaml.safe_load(path.read_text()) if path.exists() else []
    except (yaml.YAMLError, UnicodeDecodeError):
        items = []
    keys = {str(o).lstrip("+~").split("=", 1)[0] for o in items or [] if "=" in str(o)}
    return keys | {f"{k}.name" for k in keys if "." not in k}


def load_run(run_dir: Path) -> dict | None:
    rows = read_rows(run_dir / "metrics.jsonl")
    if not rows:
        return None
    info = read_info(run_dir)
    keys = {"world_size": info["world_size"], **flatten(info["config"])}
    steady = rows[len(rows) // 5:] or rows

    def med(k):
        values = [r[k] for r in steady if _number(r.get(k))]
        return statistics.median(values) if values else None

    mfu = med("mfu")  # runs before the fix logged MFU > 100% from an underestimated peak: not shown
    vals = [r["val_loss"] for r in rows if _number(r.get("val_loss"))]
    curve = [(r["step"], r["loss"]) for r in rows if _number(r.get("loss"))]
    return {"dir": run_dir, "keys": keys, "set": set_keys(run_dir), "step_s": med("step_time_s"),
            "tokens_per_s": med("tokens_per_s"), "exposed": med("comm/exposed_fraction"),
            "loss": curve[-1][1] if curve else None, "val_loss": vals[-1] if vals else None,
            "mfu": mfu if mfu is not None and mfu <= 1 else None, "steps": rows[-1]["step"], "curve": curve}


def swept_keys(runs: list[dict]) -> list[str]:
    """Keys whose values differ between runs; of those, only the ones a command line set
    when any run recorded its overrides (the rest follow from them: a group's other keys)."""
    keys = sorted({k for r in runs for k in r["keys"]})
    swept = [k for k in keys if not k.startswith(IGNORED)
             and len({json.dumps(r["keys"].get(k), sort_keys=True) for r in runs}) > 1]
    chosen = set().union(*(r["set"] for r in runs))
    if chosen:
        swept = [k for k in swept if k == "world_size" or k in chosen]
    return (["world_size"] if "world_size" in swept else []) + [k for k in swept if k != "world_size"]


def add_efficiency(runs: list[dict], swept: list[str]) -> None:
    """Against the smallest world size among runs that agree on every other swept key."""
    others = [k for k in swept if k != "world_size"]
    for r in runs:
        peers = [p for p in runs if all(p["keys"].get(k) == r["keys"].get(k) for k in others)]
        base = min(peers, key=lambda p: p["keys"]["world_size"])
        scale = r["keys"]["world_size"] / base["keys"]["world_size"]
        ok = r["tokens_per_s"] is not None and base["tokens_per_s"]
        r["efficiency"] = r["tokens_per_s"] / base["tokens_per_s"] / scale if ok else None


def table(runs: list[dict], swept: list[str]) -> str:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    head = [*swept, "steps", "step (ms)", "tokens/s", "efficiency", "exposed comm", "loss", "val loss", "mfu"]
    rows = [[r["keys"].get(k) for k in swept] + [
        r["steps"], fmt(r["step_s"] and r["step_s"] * 1e3, ".1f"), fmt(r["tokens_per_s"], ".0f"),
        fmt(r["efficiency"], ".2f"), fmt(r["exposed"], ".1%"), fmt(r["loss"], ".4f"),
        fmt(r["val_loss"], ".4f"), fmt(r["mfu"], ".2%")] for r in runs]
    return render.markdown([render.table(head, rows)])


def label(r: dict, keys: list[str], folder: Path) -> str:
    text = ", ".join(f"{k}={r['keys'].get(k)}" for k in keys) or str(r["dir"].relative_to(folder) or ".")
    return textwrap.fill(text, 48)  # a long label wraps inside the legend, not past the figure


def plot(runs: list[dict], swept: list[str], png: Path, folder: Path = Path(".")) -> None:
    """Left: tokens/s per world size, a line per value of the other swept keys. Right: every
    run's loss curve. Legends inside their axes; constrained layout keeps titles whole."""
    plt = pyplot()
    fig, (ax, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.4), layout="constrained")
    others = [k for k in swept if k != "world_size"]
    series: dict[str, list[dict]] = {}
    for r in runs:
        if r["tokens_per_s"] is not None:
            series.setdefault(label(r, others, folder) if others else "runs", []).append(r)
    for name, rs in series.items():
        rs = sorted(rs, key=lambda r: r["keys"]["world_size"])
        ax.plot([r["keys"]["world_size"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=name)
    ax.set(xlabel="world size", ylabel="tokens / s", title="throughput (median after warm-up)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    for r in runs:
        if r["curve"]:
            steps, losses = zip(*r["curve"])
            ax_loss.plot(steps, losses, label=label(r, swept, folder))
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss per run")
    for a in (ax, ax_loss):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7, ncol=1 + len(a.get_lines()) // 12)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def report(folder, out=None) -> str:
    folder = Path(folder)
    runs = [r for p in sorted(folder.rglob("metrics.jsonl")) if (r := load_run(p.parent))]
    if not runs:
        raise SystemExit(f"minddp report: error: no run (a folder with a metrics.jsonl that has rows) "
                         f"under {folder}")
    swept = swept_keys(runs)
    runs.sort(key=lambda r: [json.dumps(r["keys"].get(k), sort_keys=True) for k in swept])
    add_efficiency(runs, swept)
    text = (f"{len(runs)} runs under `{folder}`; swept: {', '.join(swept) or 'nothing'}.\n\n"
            + table(runs, swept) + "\n")
    out = Path(out) if out else folder / "report"
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(text)
    plot(runs, swept, Path(f"{out}.png"), folder)
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="minddp report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--out", help="output prefix (default FOLDER/report -> report.md, report.png)")
    args = ap.parse_args(argv)
    print(report(args.folder, args.out))
    out = args.out or str(Path(args.folder) / "report")
    print(f"wrote {out}.md and {out}.png")


if __name__ == "__main__":
    main()
