"""Which checkpoints a run keeps (train.ckpt_keep, train.ckpt_keep_every), and deleting the rest.

The newest `keep` checkpoints (0: all) and every milestone (a step divisible by `every`; 0: none)
stay; everything older goes. Rank 0 deletes, after the collective that agreed the newest save
committed, and only once that save is verified (read back): a folder's commit read it back, a
file is read back here. Checkpoints newer than the one just saved (skipped as corrupt by a
resume) are never counted or touched. Each deletion is a rename out of the listing first
(store.discard): a kill at any point leaves the newest checkpoint and nothing half-deleted that a
resume would try. A deletion that fails is one warning: nothing is lost, the disk just holds more.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from . import store
from .errors import CheckpointError
from .formats import format_of

log = logging.getLogger("minddp")


@dataclass(frozen=True)
class Retention:
    keep: int = 0  # the newest N; 0: all
    every: int = 0  # milestones kept forever: steps divisible by it; 0: none

    @classmethod
    def of(cls, keep, every) -> "Retention":
        return cls(int(keep or 0), int(every or 0))

    def describe(self) -> str:
        if not self.keep:
            return "keeping every checkpoint (train.ckpt_keep=0)"
        return (f"keeping the newest {self.keep} (train.ckpt_keep)"
                + (f" and those at steps divisible by {self.every} (train.ckpt_keep_every)"
                   if self.every else ""))

    def milestone(self, path: Path) -> bool:
        step = store.step_of(path)
        return bool(self.every) and step is not None and step % self.every == 0

    def to_delete(self, found: list[Path], newest: Path) -> list[Path]:
        """Of `found` (newest first), what goes once `newest` is saved: past the newest `keep`
        counted from `newest` down, milestones excepted."""
        if not self.keep:
            return []
        top = store.step_of(newest)
        older = [p for p in found if p != newest and (store.step_of(p) or 0) <= top]
        return [p for p in older[self.keep - 1:] if not self.milestone(p)]

    def apply(self, run_dir, newest: Path, pause=None) -> list[Path]:
        """Rank 0: delete what `to_delete` names, once `newest` is verified. Returns what was
        deleted; a failure is one warning line, and nothing else is deleted."""
        victims = self.to_delete(store.all_checkpoints(run_dir), newest)
        if not victims:
            return []
        fmt = format_of(newest)
        try:
            if not fmt.verified_by_save:
                fmt.verify(newest)
        except (CheckpointError, OSError) as e:
            log.warning(f"retention: nothing deleted, the newest checkpoint does not read back ({e})")
            return []
        deleted = []
        for p in victims:
            try:
                format_of(p).delete(p, pause)
            except OSError as e:
                log.warning(f"retention: could not delete {p} ({e.strerror or e}); it and every older "
                            "checkpoint are kept and the run goes on. Free it by hand, or fix the folder's "
                            f"permissions; {self.describe()}")
                break
            deleted.append(p)
        return deleted
