"""Checkpoints: one object per format, with the same verbs (list, save, verify, load, delete),
and the clients of those objects.

    store.py        where a run's checkpoints are and how they are named, listed, discarded
    errors.py       how a checkpoint fails: corrupt, a failed read, a failed write
    files.py        FILE: one ckpt_<step>.pt, written atomically by rank 0, read back whole
    folders.py      FOLDER (train.ckpt_format=dcp, the default): a folder ckpt_<step>/ through
                    torch.distributed.checkpoint, each rank writing its part, maybe in the
                    background (a BackgroundSave, committed after the next step)
    formats.py      the formats by name, which one a path is, load any, start-up cleanup, and
                    whether saves go to the background (train.ckpt_async)
    integrity.py    checksums of everything a checkpoint holds, its required layout, its shapes
    choice.py       which checkpoint a run resumes from (train.resume), agreed by every rank
    retention.py    which checkpoints a run keeps (train.ckpt_keep, train.ckpt_keep_every)
    state.py        RunState: what a checkpoint holds of the run (model, optimizer, schedule, data
                    position, RNG) as one Stateful piece, saved and loaded at any dp/tp layout
    manager.py      CheckpointManager: the one object the trainer calls (load, save, end)

The names of the former minddp/train/checkpoint.py are importable from here.
"""

from .choice import resolve, resolve_agreed, resume_run_dir, shape_check
from .errors import CheckpointError, CheckpointReadError, CheckpointWriteError, is_transient
from .files import FILE
from .folders import FOLDER, BackgroundSave
from .formats import FORMATS, background_saves, format_of, load, remove_crash_leftovers
from .retention import Retention
from .store import all_checkpoints, checkpoint_dir, disk_bytes, is_checkpoint_folder, latest

__all__ = ["FILE", "FOLDER", "FORMATS", "BackgroundSave", "CheckpointError", "CheckpointReadError",
           "CheckpointWriteError", "Retention", "all_checkpoints", "background_saves", "checkpoint_dir",
           "disk_bytes", "format_of", "is_checkpoint_folder", "is_transient", "latest", "load",
           "remove_crash_leftovers", "resolve", "resolve_agreed", "resume_run_dir", "shape_check"]
