"""Collect every run under a folder into one table and one plot: `minddp report DIR`.

    minddp report multirun/2026-11-30/12-00-00      # a Hydra multirun
    minddp report outputs/sweep-4242                 # a Slurm sweep array
    minddp report outputs                            # any train.py runs

A run is a folder with a `metrics.jsonl`; its `run.json` (written by rank 0 at start-up)
gives the world size and the resolved config (`.hydra/config.yaml` is the fallback). Rows
are keyed by what differs between runs (world size, bucket cap, model size, ...); columns:
median step time and tokens/s (after the first fifth of the logged steps), strong-scaling
efficiency against the smallest world size with the same other keys (the global batch is
fixed, so 1.00 is perfect), the exposed-communication fraction, final loss and validation
loss, and `mfu` where logged. Offline: no W&B server is involved. Writes DIR/report.md and
DIR/report.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ..train.resume_check import flatten
from .cli import pyplot

IGNORED = ("wandb.", "hydra.", "data.cache_dir", "train.resume", "train.stop_at_step")


def load_run(run_dir: Path) -> dict | None:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if not rows:
        return None
    info_path, hydra = run_dir / "run.json", run_dir / ".hydra" / "config.yaml"
    if info_path.exists():
        info = json.loads(info_path.read_text())
    elif hydra.exists():
        from omegaconf import OmegaConf

        info = {"world_size": 1, "config": OmegaConf.to_container(OmegaConf.load(hydra))}
    else:
        info = {"world_size": 1, "config": {}}
    keys = {"world_size": info["world_size"], **flatten(info.get("config", {}))}
    steady = rows[len(rows) // 5:] or rows
    med = lambda k: statistics.median(r[k] for r in steady if r.get(k) is not None)  # noqa: E731
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    return {"dir": run_dir, "keys": keys, "step_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"),
            "exposed": med("comm/exposed_fraction") if "comm/exposed_fraction" in rows[-1] else None,
            "loss": rows[-1]["loss"], "val_loss": vals[-1] if vals else None,
            "mfu": med("mfu") if "mfu" in rows[-1] else None, "steps": rows[-1]["step"]}


def swept_keys(runs: list[dict]) -> list[str]:
    keys = sorted({k for r in runs for k in r["keys"]})
    swept = [k for k in keys if not k.startswith(IGNORED)
             and len({json.dumps(r["keys"].get(k), sort_keys=True) for r in runs}) > 1]
    return (["world_size"] if "world_size" in swept else []) + [k for k in swept if k != "world_size"]


def add_efficiency(runs: list[dict], swept: list[str]) -> None:
    """Against the smallest world size among runs that agree on every other swept key."""
    others = [k for k in swept if k != "world_size"]
    for r in runs:
        peers = [p for p in runs if all(p["keys"].get(k) == r["keys"].get(k) for k in others)]
        base = min(peers, key=lambda p: p["keys"]["world_size"])
        scale = r["keys"]["world_size"] / base["keys"]["world_size"]
        r["efficiency"] = r["tokens_per_s"] / base["tokens_per_s"] / scale


def table(runs: list[dict], swept: list[str]) -> str:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    head = [*swept, "steps", "step (ms)", "tokens/s", "efficiency", "exposed comm", "loss", "val loss", "mfu"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [str(r["keys"].get(k)) for k in swept] + [
            str(r["steps"]), fmt(r["step_s"] * 1e3, ".1f"), fmt(r["tokens_per_s"], ".0f"),
            fmt(r["efficiency"], ".2f"), fmt(r["exposed"], ".1%"), fmt(r["loss"], ".4f"),
            fmt(r["val_loss"], ".4f"), fmt(r["mfu"], ".2%")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], swept: list[str], png: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    others = [k for k in swept if k != "world_size"]
    series: dict[str, list[dict]] = {}
    for r in runs:
        series.setdefault(", ".join(f"{k}={r['keys'].get(k)}" for k in others) or "runs", []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["keys"]["world_size"])
        ax.plot([r["keys"]["world_size"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=label)
    ax.set(xlabel="world size", ylabel="tokens / s", title="throughput per run (median after warm-up)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def report(folder, out=None) -> str:
    folder = Path(folder)
    runs = [r for p in sorted(folder.rglob("metrics.jsonl")) if (r := load_run(p.parent))]
    if not runs:
        raise SystemExit(f"minddp.tools.report: no run (a folder with metrics.jsonl) under {folder}")
    swept = swept_keys(runs)
    runs.sort(key=lambda r: [json.dumps(r["keys"].get(k), sort_keys=True) for k in swept])
    add_efficiency(runs, swept)
    text = (f"{len(runs)} runs under `{folder}`; swept: {', '.join(swept) or 'nothing'}.\n\n"
            + table(runs, swept) + "\n")
    out = Path(out) if out else folder / "report"
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(text)
    plot(runs, swept, Path(f"{out}.png"))
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="minddp report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--out", help="output prefix (default FOLDER/report -> report.md, report.png)")
    args = ap.parse_args(argv)
    print(report(args.folder, args.out))


if __name__ == "__main__":
    main()
