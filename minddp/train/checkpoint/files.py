"""The file format (`train.ckpt_format=file`, 0.4's): one `ckpt_<step>.pt` that rank 0 writes from
the whole state (gathered onto it), read back whole. Its verbs, as the folder format's:

    FILE.save(run_dir, step, state)   every rank calls it; rank 0 writes, a failure stops every rank
    FILE.verify(path)                 read back: layout and checksums (integrity.py)
    FILE.load(path, device)           the state dict; CheckpointError when corrupt
    FILE.leftovers(run_dir)           what a crash left of a write: removed at start-up

A file is written to a unique temporary name, flushed to disk, renamed into place, and the
directory fsynced, so a crash mid-write never leaves a truncated checkpoint where a resume
looks, and a power loss cannot lose the rename. Loading is `weights_only=True`: a checkpoint is
a pickle, and one from someone else must not run code on this machine. A file that cannot be
parsed, lacks a key the trainer reads or fails its checksum is corrupt (an older one may do);
an I/O or out-of-memory error is not (the file may be fine).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ...io.atomic import atomic_open, remove_files, remove_orphans
from ..safety.together import together
from . import integrity, store
from .errors import (
    CheckpointError,
    CheckpointWriteError,
    is_transient,
    is_write_failure,
    read_error,
    unreadable,
    write_error,
)

log = logging.getLogger("minddp")

ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes zip archives (since torch 1.6); minddp writes no other
_LEGACY_TMP = ".ckpt_*.pt.tmp*"  # minddp before atomic_open wrote `.ckpt_<step>.pt.tmp<pid>-<hex>`


class FileCheckpoints:
    name, suffix = "file", ".pt"
    verified_by_save = False  # written, not read back: verify() before an older one is deleted

    def path(self, run_dir, step: int) -> Path:
        return store.checkpoint_dir(run_dir) / store.name_for(step, self.suffix)

    def owns(self, path) -> bool:
        """Named like a file; whatever it is (a folder or a dangling link named so is a corrupt file)."""
        return Path(path).name.endswith(self.suffix)

    # ------------------------------------------------------------------------- save
    def save(self, run_dir, step: int, state: dict) -> Path:
        """Every rank, at the same point: rank 0 writes `state` (the same on every rank), the
        others wait for its outcome; a failed write raises CheckpointWriteError on every rank."""
        final = self.path(run_dir, step)
        return on_rank0(lambda: self.write(final, state), final, f"save step {step}")

    def write(self, final: Path, state: dict) -> Path:
        """One process: `state` and its checksums, atomically at `final`."""
        if final.is_dir() and not final.is_symlink():  # a resume skipped it as corrupt: keep it, aside
            aside = final.with_name(f"{final.name}.folder-{os.getpid()}")
            final.rename(aside)
            log.warning(f"{final} was a folder, not a checkpoint: moved to {aside}")
        try:
            with atomic_open(final) as f:
                torch.save({**state, integrity.KEY: integrity.checksums(state)}, f)
        except (OSError, RuntimeError) as e:  # the previous checkpoint stays intact either way
            if not is_write_failure(e):
                raise
            raise write_error(final, e) from e
        return final

    # ------------------------------------------------------------------------- load
    def verify(self, path) -> None:
        self.load(path, "cpu")

    def load(self, path, device) -> dict:
        """A checkpoint whose layout and checksums are whole; CheckpointError if it is corrupt,
        CheckpointReadError (or the memory error itself) if reading it failed."""
        if problem := _not_a_file(path):
            raise CheckpointError(problem)
        try:
            state = torch.load(path, map_location=device, weights_only=True)
        except Exception as e:  # noqa: BLE001 - sorted below: corrupt file, or transient failure
            if not is_transient(e, path):
                raise unreadable(path, e) from None
            if isinstance(e, OSError):
                raise read_error(path, e) from e
            raise
        return checked(path, state)

    def to_torch_file(self, path, out: Path) -> None:
        """One torch.save file of the whole checkpoint (minddp export): this is one already."""
        shutil.copyfile(path, out)

    # ------------------------------------------------------------------------- crashes
    def leftovers(self, run_dir) -> list[Path]:
        """The temporary files of writes a crash interrupted: never a checkpoint, and big."""
        d = store.checkpoint_dir(run_dir)
        found = remove_orphans(d, "ckpt_*.pt")  # atomic_open's own: removed by it
        return found + (remove_files(d.glob(_LEGACY_TMP)) if d.is_dir() else [])


def on_rank0(action, final: Path, what: str):
    """`action()` on rank 0, its result on every rank; its failure raised on every rank (a
    failed write, torch.save's full disk included, as a CheckpointWriteError): how either
    format's rank-0 writes reach every rank."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = action()
        except CheckpointWriteError as e:  # said already
            error = e
        except Exception as e:  # noqa: BLE001 - every rank stops with it, below
            error = write_error(final, e) if is_write_failure(e) else e
    return together(error, result, what=what, kinds=(CheckpointWriteError,) * 2)[0]


def checked(path, state) -> dict:
    """A loaded state with what a checkpoint must hold (integrity.REQUIRED) and matching
    checksums, else corrupt."""
    if problem := integrity.layout_problem(state, resume=False):
        raise CheckpointError(f"checkpoint {path} {problem}")
    if problem := integrity.verify(state):
        raise CheckpointError(f"checkpoint {path} is corrupt: {problem}")
    return state


def _not_a_file(path) -> str | None:
    p = Path(path)
    if p.is_symlink() and not p.exists():
        return f"checkpoint {p} is a symlink to {os.readlink(p)}, which does not exist"
    if p.is_dir():
        return f"checkpoint {p} is a folder, not a checkpoint file"
    try:  # before torch reads it: torch's refusal of a non-zip file advises weights_only=False
        with open(p, "rb") as f:
            if f.read(len(ZIP_MAGIC)) not in (ZIP_MAGIC, b""):  # empty: torch's EOFError says so
                return f"checkpoint {p} is unreadable (truncated or corrupt): not a file torch.save wrote"
    except OSError:  # a failed read: torch.load meets it again and it is reported as one
        pass
    return None


FILE = FileCheckpoints()
