"""A run's checkpoints over its life, as the trainer sees them: when a save is due, in which
format, in the background or not, which older ones go (retention), and how a save in flight
ends when the run does. torchtitan's CheckpointManager is the model; the trainer hands it a
`write(step, background)` that saves the run's state (resume/state.py), so this module knows
checkpoints, not training.

    manager = CheckpointManager(run_dir, cfg.train, device_type, say, pause)
    manager.after_step(step, last, write)   every rank, after each step
    manager.end()                           every rank, on any way out (an error included)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from . import store
from .folders import BackgroundSave
from .formats import FORMATS, background_saves
from .retention import Retention

log = logging.getLogger("minddp")


class CheckpointManager:
    def __init__(self, run_dir, t, device_type: str, say, pause=None):
        """`t`: train.* (ckpt_every, ckpt_format, ckpt_async, ckpt_keep, ckpt_keep_every,
        timeout_s); `say(line)`: rank 0's log; `pause(where, step)`: fault injection."""
        self.run_dir, self.every, self.timeout_s = run_dir, t.ckpt_every, t.timeout_s
        self.fmt = FORMATS[str(t.ckpt_format)]
        self.background, self._why_background = background_saves(t.ckpt_async, self.fmt.name, device_type)
        self.retention = Retention.of(t.ckpt_keep, t.ckpt_keep_every)
        self.say, self.pause = say, pause or (lambda where, step: None)
        self.pending: BackgroundSave | None = None  # written beside the current step

    def describe(self) -> str:
        """The start-up line: format, when, foreground or background and why, what is kept."""
        when = (f"every {self.every} steps and at the end" if self.every > 1 else
                "every step" if self.every else "at the end only")
        kind = ("dcp folders (each rank writes its part)" if self.fmt.name == "dcp"
                else "files (rank 0 writes)")
        where = "in the background" if self.background else "in the step"
        return (f"checkpoints: {kind} {when}, written {where} ({self._why_background}); "
                f"{self.retention.describe()}")

    def after_step(self, step: int, last: bool, write) -> None:
        """Every rank, after a step: commit the save written beside it, then save if one is due
        (in the background unless it is the run's last), then rank 0 applies retention to what
        is committed. `write(step, background)` -> the saved path, or a BackgroundSave."""
        if self.pending is not None:
            pending, self.pending = self.pending, None  # a failed commit is over too (removed, said)
            self._committed(pending.commit(), pending.step)
        if not ((self.every and step % self.every == 0) or last):
            return
        saved = write(step, self.background and not last)
        if isinstance(saved, BackgroundSave):
            self.pending = saved
        else:
            self._committed(saved, step)

    def _committed(self, path, step: int) -> None:
        """After the collective that agreed every rank's part of `path` is written: rank 0 alone
        deletes what retention no longer keeps."""
        self.say(f"saved {path}")
        if dist.get_rank() != 0:
            return
        pause = lambda: self.pause("checkpoint_delete", step)  # noqa: E731
        try:
            deleted = self.retention.apply(self.run_dir, path, pause)
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
