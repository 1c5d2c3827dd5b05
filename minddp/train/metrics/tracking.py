"""Run tracking on rank 0: metrics.jsonl (always), Weights & Biases, progress, and at
close the steady-state summary (summary.json beside metrics.jsonl, and W&B's summary).

Other ranks get a `NullTracker` with the same methods, so the training loop
has no `if rank == 0` around logging. W&B's config holds the Hydra config (nested: W&B shows
`train.max_steps`) and the run's identity as flat top-level keys (minddp.train.metrics.identity).
A resumed run never logs a step twice into one W&B run: it rewinds the run to the
checkpoint's step (`resume_from`), or where that is refused continues in a new run of the
same group whose config names the old one (`resumed_from`).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..io.atomic import atomic_write
from . import summary as steady

log = logging.getLogger("minddp")


def resolve_wandb_mode(mode: str) -> str:
    """auto: WANDB_MODE if set, online with an API key, else offline (never needs a server)."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (
        netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"))
    return "online" if has_key else "offline"


def _parse_row(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def _json_safe(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


class Tracker:
    def __init__(self, run_dir, config: dict, wandb_cfg, run_name: str, total_steps: int,
                 start_step: int = 0, log_every: int = 10, identity: dict | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.summary_path = self.run_dir / "summary.json"
        earlier = self._truncate_after(start_step)
        self._metrics = open(self.metrics_path, "a")
        self.mode = resolve_wandb_mode(wandb_cfg.mode)
        self.wandb_run = None
        if self.mode != "disabled":
            self.wandb_run = start_wandb(self.run_dir, wandb_cfg, run_name, self.mode,
                                         {**config, **(identity or {})}, start_step if earlier else None)
        self.interactive = sys.stderr.isatty()
        self.log_every = max(1, log_every)
        self.total, self.start_step, self.started = total_steps, start_step, time.monotonic()
        # one bar, rank 0 only; on a non-terminal (Slurm logs) plain lines every log_every steps
        # and once the first step is done, each with the elapsed time and an estimate of what is left
        self.bar = tqdm(total=total_steps, initial=start_step, desc=run_name, dynamic_ncols=True,
                        disable=not self.interactive)

    def _truncate_after(self, step: int) -> bool:
        """On resume, drop rows logged after the checkpoint: they will be logged again. A line
        a crash tore (a full disk mid-write) is dropped and reported, never fatal. True when an
        earlier part of this run logged rows."""
        if not self.metrics_path.exists():
            return False
        rows, earlier = [], False
        for n, line in enumerate(self.metrics_path.read_text(errors="replace").splitlines(), 1):
            row = _parse_row(line)
            earlier = earlier or row is not None
            if row is None and line.strip():
                log.warning(f"{self.metrics_path}: dropped line {n}, torn by an interrupted write: "
                            f"{line[:80]!r}")
            elif row is not None and row.get("step", 0) <= step:
                rows.append(line)
        atomic_write(self.metrics_path, "".join(r + "\n" for r in rows))
        return earlier

    def log(self, row: dict) -> None:
        safe = {k: _json_safe(v) for k, v in row.items()}  # NaN/inf -> null: valid JSON
        self._metrics.write(json.dumps(safe) + "\n")
        self._metrics.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
        shown = {"loss": f"{row['loss']:.4f}", "tok/s": f"{row.get('tokens_per_s', 0):.0f}"}
        if "mfu" in row:
            shown["mfu"] = f"{100 * row['mfu']:.1f}%"
        if "val_loss" in row:
            shown["val"] = f"{row['val_loss']:.4f}"
        if self.interactive:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(row["step"] - self.bar.n)
        elif row["step"] % max(10, self.log_every) == 0 or row["step"] == self.total or "val_loss" in row:
            log.info(f"step {row['step']}/{self.total} " + " ".join(f"{k} {v}" for k, v in shown.items())
                     + self.times(row["step"]))

    def step_done(self, step: int) -> None:
        """The first step's line on a non-terminal: the first metrics row may be minutes away."""
        if not self.interactive and step == self.start_step + 1 and step % max(10, self.log_every):
            log.info(f"step {step}/{self.total} done" + self.times(step))

    def times(self, step: int) -> str:
        """' elapsed 1:04 eta 3:12' (tqdm's format): the rate so far, over the steps of this part."""
        elapsed = time.monotonic() - self.started
        left = elapsed / max(1, step - self.start_step) * (self.total - step)
        return f" elapsed {tqdm.format_interval(elapsed)} eta {tqdm.format_interval(left)}"

    def info(self, msg: str) -> None:
        log.info(msg)  # Hydra's logging: the console and <run dir>/train.log

    def close(self) -> None:
        """Also on a stop signal or an error (the trainer closes in a finally): the summary
        over every part of the run that metrics.jsonl holds."""
        self.bar.close()
        self._metrics.close()
        try:
            numbers = self.write_summary()
        except OSError as e:  # a full disk: the run's own error (if any) must stay the one reported
            log.warning(f"{self.summary_path} not written ({e}); `minddp report` recomputes it")
            numbers = {}
        if self.wandb_run is not None:
            self.wandb_run.summary.update(numbers)
            self.wandb_run.finish()

    def write_summary(self) -> dict:
        rows = [r for line in self.metrics_path.read_text(errors="replace").splitlines()
                if (r := _parse_row(line)) is not None and isinstance(r.get("step"), int)]
        numbers = steady.summary(rows)
        atomic_write(self.summary_path, json.dumps(numbers, indent=1) + "\n")
        return numbers

    def next_steps(self) -> str:
        """What the end of a run prints (after W&B's own lines): where its outputs are, what to run next."""
        run = self.run_dir
        lines = [f"outputs: checkpoints (the model) in {run / 'checkpoints'}, metrics in {self.metrics_path}"]
        if self.wandb_run is not None:
            wandb_dir = Path(self.wandb_run.settings.sync_dir)
            lines.append(f"  W&B ({self.mode}): {wandb_dir}"
                         + ("  (upload it: wandb sync <that folder>)" if self.mode == "offline" else ""))
        lines.append(f"  next: minddp sample {run}   (text from the model)")
        lines.append(f"        minddp report {run}   (a table and plots; a parent folder compares runs)")
        return "\n".join(lines)


def start_wandb(run_dir: Path, wandb_cfg, name: str, mode: str, config: dict, resume_step: int | None):
    """wandb.init for this run: its group, job type, tags and flat identity; resume_step (an
    earlier part of the run logged rows) rewinds the run to that step, or where the installed
    wandb or the server cannot, starts a new run in the group linked by `resumed_from`."""
    import wandb

    run_id = _wandb_id(run_dir)
    tags = [t for t in (config.get("variant"), config.get("scaling") and f"{config['scaling']}-scaling",
                        *wandb_cfg.tags) if t]
    common = dict(project=wandb_cfg.project, group=wandb_cfg.group, name=name, mode=mode, dir=str(run_dir),
                  job_type=wandb_cfg.job_type, tags=tags,
                  # no history/summary tables and sync hints at the end: next_steps() says where things are
                  settings=wandb.Settings(quiet=True))
    if resume_step is None:
        run = wandb.init(id=run_id, resume="allow", config=config, **common)
    else:
        run = None
        if "resume_from" in inspect.signature(wandb.init).parameters:
            try:  # W&B drops the history after the step, so nothing is logged twice
                run = wandb.init(resume_from=f"{run_id}?_step={resume_step}", config=config, **common)
            except Exception as e:  # noqa: BLE001 - a server without rewind: a new run instead
                log.warning(f"W&B could not rewind run {run_id} to step {resume_step} ({e}); "
                            "continuing in a new run of the same group")
        if run is None:
            link = {"resumed_from": {"run_id": run_id, "step": resume_step}}
            run = wandb.init(id=f"{run_id}-{int(time.time())}", config={**config, **link}, **common)
    for key in steady.KEYS:  # the summary is the steady state set at close, not the last row
        run.define_metric(key, summary="none")
    return run


def _wandb_id(run_dir: Path) -> str:
    """A stable run id per run directory, so a resumed job continues the same W&B run."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]


class NullTracker:
    """What non-zero ranks get: the same interface, doing nothing."""

    def log(self, row: dict) -> None:
        pass

    def step_done(self, step: int) -> None:
        pass

    def info(self, msg: str) -> None:
        pass

    def close(self) -> None:
        pass

    def next_steps(self) -> str:
        return ""
