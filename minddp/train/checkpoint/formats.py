"""The two formats by their train.ckpt_format names, which one a checkpoint path is, and what is
the same for both: load any checkpoint, clean what a crash left at start-up, decide whether
saves go to the background (train.ckpt_async)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ...io.atomic import remove_orphans
from . import store
from .files import FILE, FileCheckpoints
from .folders import FOLDER, FolderCheckpoints

log = logging.getLogger("minddp")

FORMATS: dict[str, FileCheckpoints | FolderCheckpoints] = {FILE.name: FILE, FOLDER.name: FOLDER}


def format_of(path) -> FileCheckpoints | FolderCheckpoints:
    """A folder not named `.pt` is a folder checkpoint; anything else is read as a file (a folder
    or a dangling link named `.pt` is then a corrupt file)."""
    return FOLDER if FOLDER.owns(path) else FILE


def load(path, device) -> dict:
    """Any checkpoint, either format: its whole state, layout and checksums checked.
    CheckpointError if it is corrupt, CheckpointReadError (or the memory error) if reading failed."""
    return format_of(path).load(path, device)


STREAK = "nonfinite_streak"  # steps skipped in a row when a checkpoint was saved (0: healthy)


def saved_healthy(path) -> bool:
    """Whether a checkpoint was saved outside a non-finite streak, from its small state alone (a
    folder's state.pt; a file's pickle, its tensors mapped, not read). False when that does not
    read (corrupt, or a failed read: never counted, so an older one is kept instead); True for a
    checkpoint from before the key was saved."""
    p = Path(path)
    small = p / "state.pt" if FOLDER.owns(p) else p
    try:
        state = torch.load(small, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - any failure: not counted, which keeps more, never less
        return False
    return isinstance(state, dict) and state.get(STREAK, 0) == 0


def remove_crash_leftovers(run_dir) -> list[Path]:
    """What crashes left: each format's interrupted writes, checkpoints a kill caught half-deleted,
    and the temporary files of metrics.jsonl and run.json. Rank 0, at start-up."""
    removed = FILE.leftovers(run_dir) + FOLDER.leftovers(run_dir)
    for p in store.trash_left(run_dir):
        try:
            store.remove(p)
        except OSError as e:  # no longer listed: harmless, and never a reason not to start
            log.warning(f"could not remove {p} ({e.strerror or e}), a checkpoint whose deletion was "
                        "interrupted (train.ckpt_keep); no resume reads it: remove it by hand")
            continue
        log.warning(f"removed {p}, a checkpoint whose deletion was interrupted (train.ckpt_keep)")
    removed += remove_orphans(run_dir, "metrics.jsonl") + remove_orphans(run_dir, "run.json")
    for p in removed:
        log.warning(f"removed {p}, a temporary file left by an interrupted write")
    return removed


def background_saves(setting, ckpt_format: str, device_type: str) -> tuple[bool, str]:
    """train.ckpt_async: (on, why). `auto` is on where a background write pays: a folder whose
    staging is a device-to-host copy and whose write runs on host cores the step leaves idle
    (CUDA); off on the CPU, where the write competes with the step for the same cores
    (docs/checkpoints_at_scale.md measured the next step x2.8), and for files (rank 0 writes all)."""
    if setting in (True, False):
        return setting, "train.ckpt_async=" + str(setting).lower()
    if ckpt_format != FOLDER.name:
        return False, "train.ckpt_async=auto: off for files"
    on = device_type == "cuda"
    return on, f"train.ckpt_async=auto: {'on' if on else 'off'} for {device_type}"
