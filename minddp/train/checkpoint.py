"""Checkpoints: written atomically by rank 0, chosen by rank 0, read by every rank.

A checkpoint is one file `ckpt_<step>.pt` under `<run dir>/checkpoints/`, written to a
unique temporary name, flushed to disk, renamed into place, and the directory fsynced,
so a crash mid-write never leaves a truncated checkpoint where `latest()` finds it, and a
power loss cannot lose the rename. Loading is `weights_only=True`: a checkpoint is a
pickle, and one from someone else must not run code on this machine.

Progress is never lost: a file that cannot be parsed (corrupt) is named and skipped for
an older one, but an I/O or out-of-memory error (transient: the file may be fine) stops
the run; a run whose checkpoints all fail stops (exit 2) instead of starting over; and a
fresh start refuses a run directory that already holds checkpoints.
"""

from __future__ import annotations

import logging
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .atomic import atomic_open, remove_orphans

log = logging.getLogger("minddp")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (at start-up): the message names the file and the reason."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, quota, permissions): an I/O error, not a config one."""


class CheckpointReadError(OSError):
    """Reading a checkpoint failed for a reason outside the file (I/O error): never a fallback."""


_NAME = re.compile(r"ckpt_(\d+)\.pt$")
_LEGACY_TMP = ".ckpt_*.pt.tmp*"  # minddp before atomic_open wrote `.ckpt_<step>.pt.tmp<pid>-<hex>`


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir, step: int, state: dict) -> Path:
    d = checkpoint_dir(run_dir)
    final = d / f"ckpt_{step:08d}.pt"
    try:
        with atomic_open(final) as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as e:  # the previous checkpoint stays intact either way
        if isinstance(e, RuntimeError) and not _is_write_failure(e):
            raise
        error = CheckpointWriteError(_write_failure(final, e))
        error.errno = getattr(e, "errno", None)
        raise error from e
    return final


def _is_write_failure(e: RuntimeError) -> bool:
    """torch.save's zip writer reports a full disk as `[enforce fail at inline_container.cc]
    ... unexpected pos`, not as an OSError."""
    return any(s in str(e) for s in ("inline_container", "PytorchStreamWriter", "unexpected pos",
                                     "file write failed"))


def _write_failure(final: Path, e: BaseException) -> str:
    d = final.parent
    try:
        free = f"{shutil.disk_usage(d).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
    prev = latest(final.parent.parent)
    return (f"could not write checkpoint {final} ({reason}); {free} in {d}; the previous checkpoint "
            f"is intact ({prev.name if prev else 'none yet'}). Free space in {d} or change the run dir, "
            "then resume with train.resume=auto")


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


def remove_crash_leftovers(run_dir) -> list[Path]:
    """The temporary files of writes a crash interrupted (checkpoints, metrics.jsonl, run.json):
    never a checkpoint, and big (a whole checkpoint each). Rank 0, at start-up."""
    d = checkpoint_dir(run_dir)
    removed = remove_orphans(d, "ckpt_*.pt") + remove_orphans(run_dir, "metrics.jsonl")
    removed += remove_orphans(run_dir, "run.json")
    for p in list(d.glob(_LEGACY_TMP)) if d.is_dir() else []:
        p.unlink(missing_ok=True)
        removed.append(p)
    for p in removed:
        log.warning(f"removed {p}, a temporary file left by an interrupted write")
    return removed


_KEYS = ("model", "optimizer", "scheduler", "step")
# what a damaged file raises from torch.load: bad pickle, bad zip, truncation, wrong layout
_CORRUPT = (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, RuntimeError, ValueError, KeyError,
            IndexError, TypeError, AttributeError, UnicodeDecodeError)


def is_transient(e: BaseException) -> bool:
    """An I/O or memory failure says nothing about the file: reading it again may work."""
    if isinstance(e, (OSError, MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(e)
    return "out of memory" in text.lower() or "CUDA error" in text or not isinstance(e, _CORRUPT)


def load(path, device) -> dict:
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - sorted below: corrupt file, or transient failure
        if isinstance(e, OSError):
            error = CheckpointReadError(
                f"could not read checkpoint {path}: {e}. The file may be intact: no older "
                "checkpoint is used instead. Fix the cause, then resume with train.resume=auto")
            error.errno = e.errno
            raise error from e
        if is_transient(e):
            raise
        raise CheckpointError(_unreadable(path, e)) from None
    if not isinstance(state, dict) or any(k not in state for k in _KEYS):
        raise CheckpointError(f"{path} is not a minddp checkpoint (needs keys {list(_KEYS)})")
    return state


def _unreadable(path, e: Exception) -> str:
    if isinstance(e, pickle.UnpicklingError) and "GLOBAL" in str(e):  # torch names the class
        return (f"checkpoint {path} was refused: it holds objects beyond tensors, numbers and "
                "containers, whose loading could run code (weights_only=True). minddp never writes "
                "such checkpoints; if you trust the file, convert it to a plain state dict")
    return f"checkpoint {path} is unreadable (truncated or corrupt): {type(e).__name__}: {str(e)[:200]}"


def resolve(run_dir, resume: str, device) -> tuple[Path | None, dict | None]:
    """train.resume: none -> a fresh start, refused over existing checkpoints; a path -> that
    checkpoint or a clear error; auto -> the newest readable checkpoint of the run directory,
    skipping (and naming) corrupt ones; fresh only if the run has no checkpoint at all."""
    found = all_checkpoints(run_dir)
    if resume == "none":
        if found:
            raise CheckpointError(
                f"train.resume=none, but the run dir {run_dir} already holds {len(found)} checkpoint(s) "
                f"(newest {found[0]}) that a fresh start would overwrite: continue it with "
                "train.resume=auto, or give this run a new directory (MINDDP_RUN_DIR or hydra.run.dir)")
        return None, None
    if resume != "auto":
        return Path(resume), load(resume, device)
    failures = []
    for path in found:
        try:
            return path, load(path, device)
        except CheckpointError as e:  # corrupt: an older one may do; transient errors propagate
            failures.append(str(e))
            log.warning(f"{e}; trying the previous checkpoint")
    if failures:
        raise CheckpointError(
            f"train.resume=auto: none of the {len(found)} checkpoints in {checkpoint_dir(run_dir)} can "
            "be read, and starting over would lose the run's progress. Each one:\n  "
            + "\n  ".join(failures) + "\nNothing was changed. Resume from a good copy with "
            "train.resume=<path>, or move the checkpoints away to start over")
    return None, None


def resolve_agreed(run_dir, resume: str, device) -> tuple[Path | None, dict | None]:
    """`resolve` on rank 0, whose choice is broadcast: on a shared filesystem with attribute
    caching, ranks listing the directory themselves could resume from different steps. Any
    failure, on any rank, is raised on every rank (never a rank waiting for a dead peer)."""
    single = not dist.is_initialized() or dist.get_world_size() == 1
    if single or dist.get_rank() == 0:
        remove_crash_leftovers(run_dir)
    if single:
        return resolve(run_dir, resume, device)
    path, state, error = None, None, None
    choice = [None]
    if dist.get_rank() == 0:
        try:
            path, state = resolve(run_dir, resume, device)
            choice = [str(path) if path else None]
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = e
    dist.broadcast_object_list(choice, src=0)
    if dist.get_rank() != 0 and error is None and choice[0]:
        try:
            path, state = Path(choice[0]), load(choice[0], device)
        except Exception as e:  # noqa: BLE001
            error = e
    _raise_together(error)
    return path, state


def _raise_together(error: BaseException | None) -> None:
    """Every rank learns every rank's failure; each raises its own, or the first one's kind."""
    errors = [None] * dist.get_world_size()
    mine = None if error is None else (isinstance(error, ConfigError), f"{type(error).__name__}: {error}")
    dist.all_gather_object(errors, mine)
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, (config, text) = failed[0]
        raise (CheckpointError if config else CheckpointReadError)(f"rank {rank} could not resume: {text}")
