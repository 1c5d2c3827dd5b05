"""How a checkpoint fails, told apart: corrupt (CheckpointError: an older one may do), a failed
read (CheckpointReadError: the bytes may be fine, never a fallback), a failed write
(CheckpointWriteError: the previous checkpoint is intact). Both formats raise these, with the
same messages."""

from __future__ import annotations

import errno
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ...errors import ConfigError
from .store import latest


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (at start-up): the message names the file and the reason."""


class DifferentModel(CheckpointError):
    """A checkpoint written by another model than this run's: no fallback to an older one."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, quota, permissions): an I/O error, not a config one."""


class CheckpointReadError(OSError):
    """Reading a checkpoint failed for a reason outside the file (I/O error): never a fallback."""


# ----------------------------------------------------------------------------- writing
def write_error(final: Path, e: BaseException) -> CheckpointWriteError:
    """The error a failed checkpoint write raises: where, why, free space, what is intact."""
    d = final.parent
    try:
        free = f"{shutil.disk_usage(d).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
    prev = latest(final.parent.parent)
    error = CheckpointWriteError(
        f"could not write checkpoint {final} ({reason}); {free} in {d}; the previous checkpoint is intact "
        f"({prev.name if prev else 'none yet'}). Free space in {d} (older checkpoints are removed only "
        "after a newer one is whole: room for one more than train.ckpt_keep) or change the run dir, "
        "then resume with train.resume=auto")
    error.errno = getattr(e, "errno", None)
    return error


def is_write_failure(e: BaseException) -> bool:
    """An OSError, or torch.save's zip writer reporting a full disk (`[enforce fail at
    inline_container.cc] ... unexpected pos`), which is a RuntimeError."""
    return isinstance(e, OSError) or (isinstance(e, RuntimeError) and any(
        s in str(e) for s in ("inline_container", "PytorchStreamWriter", "unexpected pos",
                              "file write failed")))


def first_failure(e: dcp.CheckpointException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (which lists every rank's)."""
    return next(iter(e.failures.values()))[0] if e.failures else e


# ----------------------------------------------------------------------------- reading
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


def read_error(path, e: OSError) -> CheckpointReadError:
    error = CheckpointReadError(
        f"could not read checkpoint {path}: {e}. It may be intact: no older checkpoint is used "
        "instead. Fix the cause, then resume with train.resume=auto")
    error.errno = e.errno
    return error


def unreadable(path, e: BaseException) -> CheckpointError:
    if isinstance(e, pickle.UnpicklingError) and "GLOBAL" in str(e):  # torch names the class
        return CheckpointError(
            f"checkpoint {path} was refused: it holds objects beyond tensors, numbers and containers, "
            "whose loading could run code (weights_only=True). minddp never writes such checkpoints; "
            "if you trust the file, convert it to a plain state dict")
    return CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt): {type(e).__name__}: "
                           f"{str(e)[:200]}")

