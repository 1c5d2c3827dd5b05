"""Checkpoints: written atomically by rank 0, read by every rank.

A checkpoint is one file `ckpt_<step>.pt` under `<run dir>/checkpoints/`,
written to a temporary name, flushed to disk, then renamed into place, so a
crash mid-write never leaves a truncated checkpoint where `latest()` finds it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from .errors import ConfigError

log = logging.getLogger("minddp")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: the message names the file and the reason."""

_NAME = re.compile(r"ckpt_(\d+)\.pt$")


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir, step: int, state: dict) -> Path:
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"ckpt_{step:08d}.pt"
    tmp = d / f".ckpt_{step:08d}.pt.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:  # disk full, quota, killed: the previous checkpoint stays intact
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"could not write checkpoint {final} ({e.strerror or e}); the previous "
                                  f"checkpoint is intact. Free space in {d} or change the run dir.") from e
        raise
    os.replace(tmp, final)  # atomic on POSIX
    return final


def all_checkpoints(run_dir) -> list[Path]:
    """Newest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest(run_dir) -> Path | None:
    found = all_checkpoints(run_dir)
    return found[0] if found else None


_KEYS = ("model", "optimizer", "scheduler", "step")


def load(path, device) -> dict:
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # noqa: BLE001 - truncated zip, bad pickle, ...
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt): "
                              f"{type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(state, dict) or any(k not in state for k in _KEYS):
        raise CheckpointError(f"{path} is not a minddp checkpoint (needs keys {list(_KEYS)})")
    return state


def resolve(run_dir, resume: str, device) -> tuple[Path | None, dict | None]:
    """train.resume: none -> nothing; a path -> that checkpoint or a clear error; auto -> the
    newest readable checkpoint of the run directory, skipping (and naming) broken ones."""
    if resume == "none":
        return None, None
    if resume != "auto":
        return Path(resume), load(resume, device)
    for path in all_checkpoints(run_dir):
        try:
            return path, load(path, device)
        except CheckpointError as e:
            log.warning(f"{e}; trying the previous checkpoint")
    return None, None
