"""Checkpoint files: written atomically by rank 0, listed, read back whole, and told apart
when they fail (corrupt: an older one may do; transient: stop).

A checkpoint is one file `ckpt_<step>.pt` under `<run dir>/checkpoints/` (train.ckpt_format=
file), or a folder `ckpt_<step>/` that every rank wrote its part of (dcp: folders.py); both are
listed, chosen and loaded here alike, into the same state dict. A file is written to a
unique temporary name, flushed to disk, renamed into place, and the directory fsynced,
so a crash mid-write never leaves a truncated checkpoint where `latest()` finds it, and a
power loss cannot lose the rename. Loading is `weights_only=True`: a checkpoint is a
pickle, and one from someone else must not run code on this machine. A file that cannot be
parsed, lacks a key the trainer reads or fails its checksum (integrity.py) is a
CheckpointError (corrupt); an I/O or out-of-memory error is not (the file may be fine).
Which checkpoint a run resumes from: choice.py.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ...errors import ConfigError
from ..io.atomic import atomic_open, remove_orphans
from . import folders, integrity

log = logging.getLogger("minddp")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (at start-up): the message names the file and the reason."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, quota, permissions): an I/O error, not a config one."""


class CheckpointReadError(OSError):
    """Reading a checkpoint failed for a reason outside the file (I/O error): never a fallback."""


_NAME = re.compile(r"ckpt_(\d+)(\.pt)?$")
_LEGACY_TMP = ".ckpt_*.pt.tmp*"  # minddp before atomic_open wrote `.ckpt_<step>.pt.tmp<pid>-<hex>`


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir, step: int, state: dict) -> Path:
    d = checkpoint_dir(run_dir)
    final = d / f"ckpt_{step:08d}.pt"
    if final.is_dir() and not final.is_symlink():  # a resume skipped it as corrupt: keep it, aside
        aside = final.with_name(f"{final.name}.folder-{os.getpid()}")
        final.rename(aside)
        log.warning(f"{final} was a folder, not a checkpoint: moved to {aside}")
    try:
        with atomic_open(final) as f:
            torch.save({**state, integrity.KEY: integrity.checksums(state)}, f)
    except (OSError, RuntimeError) as e:  # the previous checkpoint stays intact either way
        if isinstance(e, RuntimeError) and not is_write_failure(e):
            raise
        raise write_error(final, e) from e
    return final


def write_error(final: Path, e: BaseException) -> CheckpointWriteError:
    """The error a failed checkpoint write raises: where, why, free space, what is intact."""
    error = CheckpointWriteError(_write_failure(final, e))
    error.errno = getattr(e, "errno", None)
    return error


def is_write_failure(e: RuntimeError) -> bool:
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
    """Newest first (at one step, a folder before a file)."""
    return listed(checkpoint_dir(run_dir))


def listed(folder) -> list[Path]:
    """The checkpoints (files and folders) directly in `folder`, newest first."""
    d = Path(folder)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), not m.group(2), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for *_, p in sorted(found, reverse=True)]


def is_checkpoint_folder(path) -> bool:
    """A `ckpt_<step>/` folder (train.ckpt_format=dcp): a checkpoint, not a run directory."""
    p = Path(path)
    return p.is_dir() and (m := _NAME.match(p.name)) is not None and not m.group(2)


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
    for p in sorted(d.glob(".ckpt_*.tmp-*")) if d.is_dir() else []:  # a folder save a crash interrupted
        if folders.recover(p):
            log.warning(f"{p} was a whole checkpoint whose rename a crash interrupted: put in place")
        else:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    for p in list(d.glob(".ckpt_*.old-*")) if d.is_dir() else []:  # replaced by a save of the same step
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    for p in removed:
        log.warning(f"removed {p}, a temporary file left by an interrupted write")
    return removed


_KEYS = ("model", "optimizer", "scheduler", "step")  # what any reader needs (minddp sample: model)


def is_transient(e: BaseException, path=None) -> bool:
    """An I/O or memory failure says nothing about the file: reading it again may work. Any
    other exception means the bytes were read and do not parse: a corrupt file. torch reports
    a truncated zip as EINVAL: corrupt when plain reads of the file succeed."""
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(e)
    if "out of memory" in text.lower() or "CUDA error" in text:
        return True
    if isinstance(e, OSError):
        return not (e.errno == errno.EINVAL and path is not None and _reads_fine(path))
    return False


def _reads_fine(path) -> bool:
    try:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
        return True
    except OSError:
        return False


def _not_a_file(path) -> str | None:
    p = Path(path)
    if p.is_symlink() and not p.exists():
        return f"checkpoint {p} is a symlink to {os.readlink(p)}, which does not exist"
    if p.is_dir():
        return f"checkpoint {p} is a folder, not a checkpoint file"
    return None


def load(path, device) -> dict:
    """A checkpoint whose layout and checksums are whole; CheckpointError if it is corrupt,
    CheckpointReadError (or the memory error itself) if reading it failed."""
    if folders.is_folder(path):
        state = _load_folder(Path(path), device)
    elif problem := _not_a_file(path):
        raise CheckpointError(problem)
    else:
        state = _load_file(path, device)
    if not isinstance(state, dict) or any(k not in state for k in _KEYS):
        raise CheckpointError(f"{path} is not a minddp checkpoint (needs keys {list(_KEYS)})")
    if problem := integrity.verify(state):
        raise CheckpointError(f"checkpoint {path} is corrupt: {problem}")
    return state


def _load_file(path, device) -> dict:
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - sorted below: corrupt file, or transient failure
        if not is_transient(e, path):
            raise CheckpointError(_unreadable(path, e)) from None
        if isinstance(e, OSError):
            raise _read_error(path, e) from e
        raise


def _load_folder(path: Path, device) -> dict:
    try:
        return folders.load(path, device)
    except folders.CorruptFolder as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from None
    except OSError as e:
        raise _read_error(path, e) from e
    except dcp.CheckpointException as e:  # DCP's own: the reads' failures, per rank
        cause = first_failure(e)
        if isinstance(cause, OSError):
            raise _read_error(path, cause) from e
        raise CheckpointError(_unreadable(path, cause)) from None
    except Exception as e:  # noqa: BLE001 - state.pt that does not parse, memory: sorted as a file's
        if is_transient(e):
            raise
        raise CheckpointError(_unreadable(path, e)) from None


def first_failure(e: dcp.CheckpointException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (which lists every rank's)."""
    return next(iter(e.failures.values()))[0] if e.failures else e


def _read_error(path, e: OSError) -> CheckpointReadError:
    error = CheckpointReadError(
        f"could not read checkpoint {path}: {e}. It may be intact: no older checkpoint is used "
        "instead. Fix the cause, then resume with train.resume=auto")
    error.errno = e.errno
    return error


def _unreadable(path, e: Exception) -> str:
    if isinstance(e, pickle.UnpicklingError) and "GLOBAL" in str(e):  # torch names the class
        return (f"checkpoint {path} was refused: it holds objects beyond tensors, numbers and "
                "containers, whose loading could run code (weights_only=True). minddp never writes "
                "such checkpoints; if you trust the file, convert it to a plain state dict")
    return f"checkpoint {path} is unreadable (truncated or corrupt): {type(e).__name__}: {str(e)[:200]}"
