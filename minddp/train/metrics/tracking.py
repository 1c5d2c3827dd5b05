"""Run tracking on rank 0: metrics.jsonl (always), Weights & Biases, progress, and at
close the steady-state summary (summary.json beside metrics.jsonl, and W&B's summary).

Other ranks get a `NullTracker` with the same methods, so the training loop
has no `if rank == 0` around logging. W&B's config holds the Hydra config (nested: W&B shows
`train.max_steps`) and the run's identity as flat top-level keys (minddp.train.metrics.identity).
W&B's side (its mode, a run that cannot start, a resume that rewinds and re-logs what W&B
lacks) is minddp.train.metrics.wandb_run: it never takes the run down.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ...io.atomic import atomic_write
from . import summary as steady
from . import wandb_run
from .wandb_run import resolve_mode as resolve_wandb_mode  # noqa: F401 - its name for the tools

log = logging.getLogger("minddp")


def _parse_row(line: str) -> dict | None:
    """A metrics row, or None for a line no run wrote whole: not JSON, or no integer step
    ({"step": null} would stop every resume's comparison with a TypeError)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(row, dict) and type(row.get("step")) is int
    return row if ok else None


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
        self.mode = wandb_run.resolve_mode(wandb_cfg.mode)
        self.wandb_run, self.last_step = None, start_step
        if self.mode != "disabled":  # None where W&B cannot start: the run goes on without it
            resume = start_step if earlier else None
            self.wandb_run = wandb_run.open_run(self.run_dir, wandb_cfg, run_name, self.mode,
                                                {**config, **(identity or {})}, resume, self.rows())
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
            elif row is not None and row["step"] <= step:
                rows.append(line)
        atomic_write(self.metrics_path, "".join(r + "\n" for r in rows))
        return earlier

    def log(self, row: dict) -> None:
        safe = {k: _json_safe(v) for k, v in row.items()}  # NaN/inf -> null: valid JSON
        self._metrics.write(json.dumps(safe) + "\n")
        self._metrics.flush()
        self.last_step = row["step"]
        if self.wandb_run is not None:
            values = {k: v for k, v in row.items() if k != "step"}
            self._to_wandb(lambda run: run.log(values, step=row["step"]))
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

    def first_step_done(self, step: int) -> None:
        """The first step's line on a non-terminal, unless its metrics row comes with it."""
        if not self.interactive and step % max(10, self.log_every):
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

        def finish(run):
            run.summary.update(numbers)
            run.finish()

        if self.wandb_run is not None and self._to_wandb(finish):
            wandb_run.mark_written(self.run_dir, self.last_step)  # finished: its files hold every step

    def _to_wandb(self, call) -> bool:
        """call(the W&B run); where W&B fails (a full disk, its service gone), one warning and the
        run goes on without it. True when it worked."""
        try:
            call(self.wandb_run)
            return True
        except Exception as e:  # noqa: BLE001 - W&B must never take a run down
            log.warning(f"W&B: stopped logging ({type(e).__name__}: {str(e)[:200]}); training goes on, "
                        f"metrics in {self.metrics_path}")
            self.wandb_run = None
            return False

    def rows(self) -> list[dict]:
        """metrics.jsonl's rows (every part of the run so far)."""
        if not self.metrics_path.exists():
            return []
        return [r for line in self.metrics_path.read_text(errors="replace").splitlines()
                if (r := _parse_row(line)) is not None]

    def write_summary(self) -> dict:
        numbers = steady.summary(self.rows())
        atomic_write(self.summary_path, json.dumps(numbers, indent=1) + "\n")
        return numbers

    def next_steps(self) -> str:
        """What the end of a run prints (after W&B's own lines): where its outputs are, what to run next."""
        run = self.run_dir
        lines = [f"outputs: checkpoints (the model) in {run / 'checkpoints'}, metrics in {self.metrics_path}"]
        if self.wandb_run is not None:
            wandb_dir = Path(self.wandb_run.settings.sync_dir)
            offline = self.wandb_run.offline  # as it started: an online run that could not is offline
            lines.append(f"  W&B ({'offline' if offline else self.mode}): {wandb_dir}"
                         + ("  (upload it: wandb sync <that folder>)" if offline else ""))
        lines.append(f"  next: minddp sample {run}   (text from the model)")
        lines.append(f"        minddp report {run}   (a table and plots; a parent folder compares runs)")
        return "\n".join(lines)


class NullTracker:
    """What non-zero ranks get: the same interface, doing nothing."""

    def log(self, row: dict) -> None:
        pass

    def first_step_done(self, step: int) -> None:
        pass

    def info(self, msg: str) -> None:
        pass

    def close(self) -> None:
        pass

    def next_steps(self) -> str:
        return ""
