"""Checkpoints: written atomically by rank 0, chosen by rank 0, read by every rank.

A checkpoint is one file `ckpt_<step>.pt` under `<run dir>/checkpoints/`, written to a
unique temporary name, flushed to disk, renamed into place, and the directory fsynced,
so a crash mid-write never leaves a truncated checkpoint where `latest()` finds it, and a
power loss cannot lose the rename. Loading is `weights_only=True`: a checkpoint is a
pickle, and one from someone else must not run code on this machine.

Progress is never lost: a file that cannot be parsed, lacks a key the trainer reads, fails
its checksum (integrity.py) or holds a tensor of the wrong shape (corrupt) is named and
skipped for an older one, but an I/O or out-of-memory error (transient: the file may be fine)
stops the run; a run whose checkpoints all fail stops (exit 2) instead of starting over; a
fresh start refuses a run directory that already holds checkpoints; and a `checkpoints` link
to nothing (an unmounted disk) is refused instead of read as "no checkpoints".
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
import torch.distributed as dist

from ..errors import ConfigError
from . import integrity
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
    if final.is_dir() and not final.is_symlink():  # a resume skipped it as corrupt: keep it, aside
        aside = final.with_name(f"{final.name}.folder-{os.getpid()}")
        final.rename(aside)
        log.warning(f"{final} was a folder, not a checkpoint: moved to {aside}")
    try:
        with atomic_open(final) as f:
            torch.save({**state, integrity.KEY: integrity.checksums(state)}, f)
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
    if problem := _not_a_file(path):
        raise CheckpointError(problem)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - sorted below: corrupt file, or transient failure
        if not is_transient(e, path):
            raise CheckpointError(_unreadable(path, e)) from None
        if isinstance(e, OSError):
            error = CheckpointReadError(
                f"could not read checkpoint {path}: {e}. The file may be intact: no older "
                "checkpoint is used instead. Fix the cause, then resume with train.resume=auto")
            error.errno = e.errno
            raise error from e
        raise
    if not isinstance(state, dict) or any(k not in state for k in _KEYS):
        raise CheckpointError(f"{path} is not a minddp checkpoint (needs keys {list(_KEYS)})")
    if problem := integrity.verify(state):
        raise CheckpointError(f"checkpoint {path} is corrupt: {problem}")
    return state


def _unreadable(path, e: Exception) -> str:
    if isinstance(e, pickle.UnpicklingError) and "GLOBAL" in str(e):  # torch names the class
        return (f"checkpoint {path} was refused: it holds objects beyond tensors, numbers and "
                "containers, whose loading could run code (weights_only=True). minddp never writes "
                "such checkpoints; if you trust the file, convert it to a plain state dict")
    return f"checkpoint {path} is unreadable (truncated or corrupt): {type(e).__name__}: {str(e)[:200]}"


def resume_run_dir(resume: str) -> Path | None:
    """The run dir a `train.resume=<folder>` names: the folder, or its parent when the folder
    is the checkpoints folder itself. None when resume is not a folder."""
    p = Path(resume)
    if resume in ("none", "auto") or not p.is_dir():
        return None
    return p.parent if p.name == "checkpoints" or any(p.glob("ckpt_*.pt")) else p


def _check_link(run_dir) -> None:
    d = checkpoint_dir(run_dir)
    if d.is_symlink() and not d.exists():
        raise CheckpointError(
            f"{d} is a symlink to {os.readlink(d)}, which does not exist (an unmounted disk?): the run's "
            "checkpoints cannot be seen. Mount it or fix the link (or remove it to start over); nothing "
            "was changed")
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"{d} is not a folder: move it away; nothing was changed")


def resolve(run_dir, resume: str, device, accept=None) -> tuple[Path | None, dict | None]:
    """train.resume: none -> a fresh start, refused over existing checkpoints; a file -> that
    checkpoint or a clear error; auto, or this run dir (or its checkpoints folder) -> its
    newest usable checkpoint, skipping (and naming) corrupt ones; fresh (auto only) if the
    run has none. `accept(path, state)` may refuse a loaded state as corrupt (CheckpointError)."""
    _check_link(run_dir)
    found = all_checkpoints(run_dir)
    if resume == "none":
        if found:
            raise CheckpointError(
                f"train.resume=none, but the run dir {run_dir} already holds {len(found)} checkpoint(s) "
                f"(newest {found[0]}) that a fresh start would overwrite: continue it with "
                "train.resume=auto, or give this run a new directory (MINDDP_RUN_DIR or hydra.run.dir)")
        return None, None
    folder = resume_run_dir(resume)
    if folder is None and resume != "auto":
        if not os.path.exists(resume):
            raise CheckpointError(f"train.resume={resume!r}: no such checkpoint (use none, auto or a path)")
        return _accepted(Path(resume), load(resume, device), accept)
    if folder is not None and os.path.realpath(folder) != os.path.realpath(run_dir):
        raise CheckpointError(
            f"train.resume={resume} continues the run dir {folder}, but this run writes to {run_dir} "
            "(MINDDP_RUN_DIR or hydra.run.dir): unset that, or give train.resume a checkpoint file")
    if not found:
        if folder is not None:
            raise CheckpointError(f"no checkpoint in {checkpoint_dir(run_dir)}: nothing to resume. Start "
                                  "that run dir fresh with train.resume=auto")
        log.info(f"no checkpoint in {checkpoint_dir(run_dir)}: starting fresh")
        return None, None
    return _newest_usable(run_dir, found, device, accept)


def _accepted(path: Path, state: dict, accept) -> tuple[Path, dict]:
    """A state to resume from: every nested key the trainer reads, and what `accept` checks."""
    if problem := integrity.layout_problem(state):
        raise CheckpointError(f"checkpoint {path} is corrupt: {problem}")
    if accept is not None:
        accept(path, state)
    return path, state


def _newest_usable(run_dir, found: list[Path], device, accept) -> tuple[Path, dict]:
    failures = []
    for path in found:
        try:
            return _accepted(path, load(path, device), accept)
        except CheckpointError as e:  # corrupt: an older one may do; transient errors propagate
            failures.append(str(e))
            log.warning(f"{e}; trying the previous checkpoint")
    raise CheckpointError(
        f"train.resume=auto: none of the {len(found)} checkpoints in {checkpoint_dir(run_dir)} can "
        "be read, and starting over would lose the run's progress. Each one:\n  "
        + "\n  ".join(failures) + "\nNothing was changed. Resume from a good copy with "
        "train.resume=<path>, or move the checkpoints away to start over")


def resolve_agreed(run_dir, resume: str, device, accept=None) -> tuple[Path | None, dict | None]:
    """`resolve` on rank 0, whose choice is broadcast: on a shared filesystem with attribute
    caching, ranks listing the directory themselves could resume from different steps. Any
    failure, on any rank, is raised on every rank (never a rank waiting for a dead peer)."""
    single = not dist.is_initialized() or dist.get_world_size() == 1
    if single or dist.get_rank() == 0:
        remove_crash_leftovers(run_dir)
    if single:
        return resolve(run_dir, resume, device, accept)
    path, state, error = None, None, None
    choice = [None]
    if dist.get_rank() == 0:
        try:
            path, state = resolve(run_dir, resume, device, accept)
            choice = [str(path) if path else None]
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = e
    dist.broadcast_object_list(choice, src=0)
    if dist.get_rank() != 0 and error is None and choice[0]:
        try:
            path, state = _accepted(Path(choice[0]), load(choice[0], device), accept)
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
