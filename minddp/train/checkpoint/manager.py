"""A run's checkpoints over its life, as the trainer sees them: when a save is due, in which
format, in the background or not, which older ones go (retention), and how a save in flight
ends when the run does. torchtitan's CheckpointManager is the model; the trainer hands it a
`write(step, background)` that saves the run's state (resume/state.py), so this module knows
checkpoints, not training.

    manager = CheckpointManager(run_dir, cfg.train, device_type, say, pause, resumed_at)
    manager.after_step(step, last, write, healthy)   every rank, after each step
    manager.end()                           every rank, on any way out (an error included)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from ..safety.together import together
from . import store
from .errors import CheckpointError
from .folders import BackgroundSave
from .formats import FORMATS, background_saves, saved_healthy
from .retention import Retention

log = logging.getLogger("minddp")


class CheckpointManager:
    def __init__(self, run_dir, t, device_type: str, say, pause=None, resumed_at: int = 0):
        """Every rank, at start-up. `t`: train.* (ckpt_every, ckpt_format, ckpt_async, ckpt_keep,
        ckpt_keep_every, timeout_s); `say(line)`: rank 0's log; `pause(where, step)`: fault
        injection; `resumed_at`: the step this run resumed from (0: a fresh run)."""
        self.run_dir, self.every, self.timeout_s = run_dir, t.ckpt_every, t.timeout_s
        self.fmt = FORMATS[str(t.ckpt_format)]
        self.background, self._why_background = background_saves(t.ckpt_async, self.fmt.name, device_type)
        self.retention = Retention.of(t.ckpt_keep, t.ckpt_keep_every)
        self.say, self.pause = say, pause or (lambda where, step: None)
        self.pending: BackgroundSave | None = None  # written beside the current step
        self._pending_healthy = True
        self._check_writable()
        # newer than the resumed step: skipped by the resume (corrupt) or left behind by it; none
        # counts toward train.ckpt_keep until this run saves its step again
        self._counted = {p.name: False for p in store.all_checkpoints(run_dir)
                         if (store.step_of(p) or 0) > resumed_at}
        if dist.get_rank() == 0 and (caveat := self.retention.caveat(self.every)):
            log.warning(caveat)

    def _check_writable(self) -> None:
        """Every rank: a checkpoints folder this run cannot write is one line at start-up (exit 2
        on every rank), not an error at the first save. Every rank writes a folder's files;
        rank 0 alone a file."""
        error = None
        if self.fmt.name == "dcp" or dist.get_rank() == 0:
            error = store.write_problem(self.run_dir)
        together(None if error is None else CheckpointError(error), kinds=(CheckpointError, CheckpointError))

    def describe(self) -> str:
        """The start-up line: format, when, foreground or background and why, what is kept."""
        when = (f"every {self.every} steps and at the end" if self.every > 1 else
                "every step" if self.every else "at the end only")
        kind = ("dcp folders (each rank writes its part)" if self.fmt.name == "dcp"
                else "files (rank 0 writes)")
        where = "in the background" if self.background else "in the step"
        return (f"checkpoints: {kind} {when}, written {where} ({self._why_background}); "
                f"{self.retention.describe()}")

    def after_step(self, step: int, last: bool, write, healthy: bool = True) -> None:
        """Every rank, after a step: commit the save written beside it, then save if one is due
        (in the background unless it is the run's last), then rank 0 applies retention to what
        is committed. `write(step, background)` -> the saved path, or a BackgroundSave;
        `healthy`: no step was skipped as non-finite in a row up to this one (the guard's)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None  # a failed commit is over too (removed, said)
            self._committed(pending.commit(), pending.step, self._pending_healthy)
        if not ((self.every and step % self.every == 0) or last):
            return
        saved = write(step, self.background and not last)
        if isinstance(saved, BackgroundSave):
            self.pending, self._pending_healthy = saved, healthy
        else:
            self._committed(saved, step, healthy)

    def _counts(self, path) -> bool:
        """Whether a checkpoint counts toward train.ckpt_keep (retention.py): this run's saves
        and what its resume left behind are known; any other is read once."""
        name = Path(path).name
        if name not in self._counted:
            self._counted[name] = saved_healthy(path)
        return self._counted[name]

    def _committed(self, path, step: int, healthy: bool = True) -> None:
        """After the collective that agreed every rank's part of `path` is written: rank 0 alone
        deletes what retention no longer keeps."""
        self.say(f"saved {path}")
        if dist.get_rank() != 0:
            return
        self._counted[Path(path).name] = healthy
        pause = lambda: self.pause("checkpoint_delete", step)  # noqa: E731
        try:
            deleted = self.retention.apply(self.run_dir, path, pause, self._counts)
        except Exception as e:  # noqa: BLE001 - rank 0 alone, after the last collective: never raise here
            log.warning(f"retention: nothing deleted after {Path(path).name} "
                        f"({type(e).__name__}: {e}); every checkpoint is kept and the run goes on")
            return
        if deleted:
            self.say(f"removed {', '.join(p.name for p in deleted)} ({self.retention.describe()})")

    def end(self) -> None:
        """On a way out that is not the loop's own end (an error): the save in flight completed
        and committed, or removed, said in one line; never left running into the process's
        teardown, which aborts (SIGABRT) under a thread inside a collective."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        line = pending.end(self.timeout_s)
        if line:
            self.say(line)

    def usage(self) -> str:
        """The run's end: what its checkpoints are and take on disk."""
        found = store.all_checkpoints(self.run_dir)
        steps = ", ".join(str(store.step_of(p)) for p in found[:6]) + (", ..." if len(found) > 6 else "")
        return (f"checkpoints: {len(found)} in {store.checkpoint_dir(self.run_dir)}"
                + (f" (steps {steps})" if found else "")
                + f", {store.disk_bytes(self.run_dir) / 2**20:.1f} MiB on disk")
