"""Which checkpoints a run keeps (train.ckpt_keep, train.ckpt_keep_every), and deleting the rest.

The newest `keep` checkpoints (0: all), the newest `keep` that count, and every milestone (a step
divisible by `every`; 0: none) stay; everything older goes. A checkpoint counts unless it was
saved during a non-finite streak (steps skipped by train.on_nonfinite=skip: its weights may be
the diverged ones) or is known to be corrupt (a resume skipped it, its small state does not
read): such ones never take a slot, so the newest healthy checkpoint from before a streak stays
until `keep` healthy ones are saved past it, and the guard's advice (resume from an earlier
checkpoint) stays possible. Rank 0 deletes, after the collective that agreed the newest save
committed, and only once that save is verified (read back): a folder's commit read it back, a
file is read back here. Checkpoints newer than the one just saved (skipped as corrupt by a
resume) are never counted or touched. Each deletion is a rename out of the listing first
(store.discard): a kill at any point leaves the newest checkpoint and nothing half-deleted that a
resume would try. A deletion that fails is one warning: nothing is lost, the disk just holds more.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import islice
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
            return "keeping every checkpoint (train.ckpt_keep=0" + (
                f"; train.ckpt_keep_every={self.every} changes nothing)" if self.every else ")")
        return (f"keeping the newest {self.keep} (train.ckpt_keep)"
                + (f" and those at steps divisible by {self.every} (train.ckpt_keep_every)"
                   if self.every else ""))

    def caveat(self, ckpt_every: int) -> str | None:
        """A start-up warning where the settings do not do what they seem to."""
        if self.keep and self.every and ckpt_every and ckpt_every % self.every == 0:
            return (f"train.ckpt_keep_every={self.every} divides train.ckpt_every={ckpt_every}: every "
                    f"checkpoint is a milestone kept forever, so train.ckpt_keep={self.keep} deletes none "
                    "and the disk grows by one checkpoint per save. Set train.ckpt_keep_every to a multiple "
                    f"of {ckpt_every} larger than it (milestones among the saves), or 0")
        return None

    def milestone(self, path: Path) -> bool:
        step = store.step_of(path)
        return bool(self.every) and step is not None and step % self.every == 0

    def to_delete(self, found: list[Path], newest: Path, counts=None) -> list[Path]:
        """Of `found` (newest first), what goes once `newest` is saved: all but the newest `keep`
        from `newest` down, the newest `keep` of those for which `counts(path)` (default: all),
        and milestones."""
        if not self.keep:
            return []
        top = store.step_of(newest)
        mine = [newest] + [p for p in found if p != newest and (store.step_of(p) or 0) <= top]
        healthy = list(islice((p for p in mine if counts is None or counts(p)), self.keep))
        kept = set(mine[:self.keep]) | set(healthy)
        return [p for p in mine if p not in kept and not self.milestone(p)]

    def apply(self, run_dir, newest: Path, pause=None, counts=None) -> list[Path]:
        """Rank 0: delete what `to_delete` names, once `newest` is verified. Returns what was
        deleted; a failure is one warning line, and nothing else is deleted."""
        victims = self.to_delete(store.all_checkpoints(run_dir), newest, counts)
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
                store.discard(p, pause)  # either format: renamed out of the listing, then removed
            except OSError as e:
                log.warning(f"retention: could not delete {p} ({e.strerror or e}); it and every older "
                            "checkpoint are kept and the run goes on. Free it by hand, or fix the folder's "
                            f"permissions; {self.describe()}")
                break
            deleted.append(p)
        return deleted
