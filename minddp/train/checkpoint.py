"""Checkpoints: written atomically by rank 0, chosen by rank 0, read by every rank.

A checkpoint is one file `ckpt_<step>.pt` under `<run dir>/checkpoints/`, written to a
unique temporary name, flushed to disk, renamed into place, and the directory fsynced,
so a crash mid-write never leaves a truncated checkpoint where `latest()` finds it, and a
power loss cannot lose the rename. Loading is `weights_only=True`: a checkpoint is a
pickle, and one from someone else must not run code on this machine.
"""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .atomic import atomic_open

log = logging.getLogger("minddp")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (at start-up): the message names the file and the reason."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, quota, permissions): an I/O error, not a config one."""


_NAME = re.compile(r"ckpt_(\d+)\.pt$")


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir, step: int, state: dict) -> Path:
    d = checkpoint_dir(run_dir)
    final = d / f"ckpt_{step:08d}.pt"
    try:
        with atomic_open(final) as f:
            torch.save(state, f)
    except OSError as e:  # disk full, quota, read-only: the previous checkpoint stays intact
        raise CheckpointWriteError(
            e.errno, f"could not write checkpoint {final} ({e.strerror or e}); the previous checkpoint "
            f"is intact. Free space in {d} or change the run dir, then resume with train.resume=auto") from e
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
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        if "GLOBAL" in str(e):  # torch names the class or function the pickle wanted to call
            raise CheckpointError(
                f"checkpoint {path} was refused: it holds objects beyond tensors, numbers and "
                "containers, whose loading could run code (weights_only=True). minddp never writes "
                "such checkpoints; if you trust the file, convert it to a plain state dict") from None
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt): "
                              f"{str(e)[:200]}") from None
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


def resolve_agreed(run_dir, resume: str, device) -> tuple[Path | None, dict | None]:
    """`resolve` on rank 0, whose choice is broadcast: on a shared filesystem with attribute
    caching, ranks listing the directory themselves could resume from different steps."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return resolve(run_dir, resume, device)
    choice, error = [None, None], None
    if dist.get_rank() == 0:
        try:
            path, state = resolve(run_dir, resume, device)
            choice = [str(path) if path else None, None]
        except CheckpointError as e:
            error, choice = e, [None, str(e)]
    dist.broadcast_object_list(choice, src=0)
    if choice[1] is not None:
        raise error or CheckpointError(choice[1])
    if dist.get_rank() == 0:
        return path, state
    return (Path(choice[0]), load(choice[0], device)) if choice[0] else (None, None)
