"""Trainer runs read back from their folders (`minddp report` and its W&B report run, and
`minddp scaling --reuse`, are the front ends): the rows of a metrics.jsonl, a run's world size
and config, the keys a sweep varied, the scaling efficiency between runs, and the series the
report plots. Files only: nothing of the trainer is imported.

A run is a folder with a `metrics.jsonl`; its `run.json` (written by rank 0 at start-up) gives
the world size and the resolved config (`.hydra/config.yaml` is the fallback); the keys set on
its command line are in `.hydra/overrides.yaml`. `read_run` is the one reader: a torn or blank
line is skipped (one warning), a run whose files cannot be read as a run is a `BadRun` that
names it and why, so a front end reports the others.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from .costmodel import Calibration, load_calibration, predicted_comm

IGNORED = ("wandb.", "hydra.", "data.cache_dir", "train.resume", "train.stop_at_step")


class BadRun(ValueError):
    """A folder whose files cannot be read as a run (they parse but have the wrong shape, or
    none of its rows is a row): the message names the folder and why, in one line."""


def run_folders(folder: Path) -> list[Path]:
    """The folders under `folder` that hold a metrics.jsonl (a dangling link too: it is named,
    not passed over)."""
    return sorted(Path(top) for top, _, files in os.walk(folder) if "metrics.jsonl" in files)


def read_run(run_dir: Path, tool: str = "minddp report") -> dict:
    """A run folder, read once for `minddp report` (and its W&B run) and `minddp scaling
    --reuse`: its rows, world size, config, identity and the keys its command line set.
    Malformed rows are skipped with one warning; a run that cannot be read raises BadRun."""
    try:
        rows = read_rows(run_dir / "metrics.jsonl", tool)
    except OSError as e:  # a dangling link, a folder, no permission
        raise BadRun(f"{run_dir}: metrics.jsonl cannot be read ({e.strerror or e})") from None
    if not rows:
        raise BadRun(f"{run_dir}: metrics.jsonl has no rows")
    return {"rows": rows, **read_info(run_dir), "set": set_keys(run_dir)}


def read_rows(path: Path, tool: str = "minddp report") -> list[dict]:
    """The rows of a metrics.jsonl that a run wrote: a dict with an integer step. Blank lines
    are skipped; anything else too, and said in one line."""
    rows, bad = [], []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and _whole(row.get("step"), 0):
            rows.append(row)
        else:
            bad.append(n)
    if bad:
        print(f"{tool}: warning: {path}: skipped {len(bad)} malformed row(s) (line "
              f"{', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''})", file=sys.stderr)
    return rows


def read_info(run_dir: Path) -> dict:
    """World size, config and identity: run.json, else .hydra/config.yaml (world 1), else blank."""
    info_path, hydra = run_dir / "run.json", run_dir / ".hydra" / "config.yaml"
    if info_path.exists() or info_path.is_symlink():
        info = _parsed(run_dir, "run.json", json.loads)
        if not isinstance(info, dict) or not isinstance(info.get("config", {}), dict):
            raise BadRun(f"{run_dir}: run.json is not minddp's (an object whose config is an object)")
        world, config = info.get("world_size", 1), info.get("config", {})
        if not _whole(world, 1):
            raise BadRun(f"{run_dir}: run.json's world_size must be a whole number >= 1, got {world!r}")
        return {"world_size": world, "config": config,
                "identity": {k: v for k, v in info.items() if k not in ("config", "data")}}
    if hydra.exists() or hydra.is_symlink():
        config = _parsed(run_dir, ".hydra/config.yaml", yaml.safe_load)
        if not isinstance(config, (dict, type(None))):
            raise BadRun(f"{run_dir}: .hydra/config.yaml holds a {type(config).__name__}, not a mapping")
        return {"world_size": 1, "config": config or {}, "identity": {}}
    return {"world_size": 1, "config": {}, "identity": {}}


def set_keys(run_dir: Path) -> set[str]:
    """The keys set on this run's command line (`model=mlp` sets model.name)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    items = _parsed(run_dir, ".hydra/overrides.yaml", yaml.safe_load) if path.exists() else []
    if not isinstance(items, (list, type(None))):
        raise BadRun(f"{run_dir}: .hydra/overrides.yaml holds a {type(items).__name__}, not a list")
    keys = {str(o).lstrip("+~").split("=", 1)[0] for o in items or [] if "=" in str(o)}
    return keys | {f"{k}.name" for k in keys if "." not in k}


def _parsed(run_dir: Path, name: str, parse):
    """A run file parsed, or BadRun naming it."""
    try:
        return parse((run_dir / name).read_text())
    except OSError as e:  # a folder in its place, a dangling link
        raise BadRun(f"{run_dir}: {name} cannot be read ({e.strerror or e})") from None
    except (ValueError, yaml.YAMLError) as e:  # UnicodeDecodeError is a ValueError
        raise BadRun(f"{run_dir}: {name} does not parse ({str(e).splitlines()[0][:120]})") from None


def _whole(value, least: int) -> bool:
    """An int (not a bool) >= least."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


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
    """Against the smallest world size among runs that agree on every other swept key and on
    the scaling mode. Strong (fixed global batch): T1 / (n Tn), as tokens/s per rank against the
    base's; weak (fixed batch per rank, the work grows with n): T1 / Tn, the step times alone."""
    others = [k for k in swept if k != "world_size"]
    for r in runs:
        peers = [p for p in runs if p["scaling"] == r["scaling"]
                 and all(p["keys"].get(k) == r["keys"].get(k) for k in others)]
        base = min(peers, key=lambda p: p["keys"]["world_size"])
        scale = r["keys"]["world_size"] / base["keys"]["world_size"]
        if r["scaling"] == "weak":
            ok = r["step_s"] and base["step_s"]
            r["efficiency"] = base["step_s"] / r["step_s"] if ok else None
        else:
            ok = r["tokens_per_s"] is not None and base["tokens_per_s"]
            r["efficiency"] = r["tokens_per_s"] / base["tokens_per_s"] / scale if ok else None


def study_group(runs: list[dict], folder: Path) -> tuple[str, str]:
    """(project, group): the runs' own W&B project and group where they share one, else the folder's name."""
    groups = {r["keys"].get("wandb.group") for r in runs}
    projects = {r["keys"].get("wandb.project") for r in runs} - {None}
    group = groups.pop() if len(groups) == 1 and None not in groups else Path(folder).resolve().name
    return (projects.pop() if len(projects) == 1 else "minddp"), group


def series(runs: list[dict], swept: list[str], x: str = "world_size") -> dict[str, list[dict]]:
    """The runs by the values of the swept keys other than `x`, each sorted by `x`."""
    others = [k for k in swept if k != x]
    out: dict[str, list[dict]] = {}
    for r in runs:
        name = ", ".join(f"{k}={r['keys'].get(k)}" for k in others) or "runs"
        out.setdefault(name, []).append(r)
    return {k: sorted(v, key=lambda r: r["keys"][x]) for k, v in out.items()}


def predicted_busy(r: dict, cal: Calibration) -> float | None:
    """The cost model's busy time for this run's buckets (equal shares of its measured bytes)."""
    if r["step_s"] is None:
        return None
    count, nbytes = r["last"].get("comm/collectives") or 0, r["last"].get("comm/bytes") or 0
    exposed = r["summary"].get("comm/exposed_wait_s") or 0
    return predicted_comm([nbytes / count] * count if count else [], r["keys"]["world_size"], cal,
                          r["step_s"], exposed, r["identity"].get("accumulation") or 1,
                          r["identity"].get("variant") or "ddp")["busy_s"]


def lines(runs: list[dict], swept: list[str]) -> dict[str, tuple[list, list, list[str]]]:
    """Plot name -> (xs per line, ys per line, line names): what the W&B report run's charts draw,
    against the world size, a line per value of the other swept keys."""
    cal, out = load_calibration(), {}

    def add(plot, name, rs, value):
        pts = [(r["keys"]["world_size"], value(r)) for r in rs]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            xs, ys, names = out.setdefault(plot, ([], [], []))
            xs.append([x for x, _ in pts]), ys.append([y for _, y in pts]), names.append(name)

    for name, rs in series(runs, swept).items():
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
