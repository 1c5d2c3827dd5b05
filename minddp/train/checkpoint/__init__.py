"""Checkpoints:

    files.py        one file per step, written atomically by rank 0, listed, read back whole;
                    a corrupt file (CheckpointError) told apart from a failed read
    folders.py      one folder per step through torch.distributed.checkpoint, each rank
                    writing its part (train.ckpt_format=dcp); loaded into a file's state dict
    integrity.py    checksums of everything a checkpoint holds, its required layout, its shapes
    choice.py       which checkpoint a run resumes from (train.resume), agreed by every rank

The names of the former minddp/train/checkpoint.py are importable from here.
"""

from .choice import resolve, resolve_agreed, resume_run_dir, shape_check
from .files import (
    CheckpointError,
    CheckpointReadError,
    CheckpointWriteError,
    all_checkpoints,
    checkpoint_dir,
    is_checkpoint_folder,
    is_transient,
    latest,
    load,
    remove_crash_leftovers,
    save,
)

__all__ = ["CheckpointError", "CheckpointReadError", "CheckpointWriteError", "all_checkpoints",
           "checkpoint_dir", "is_checkpoint_folder", "is_transient", "latest", "load",
           "remove_crash_leftovers", "resolve", "resolve_agreed", "resume_run_dir", "save", "shape_check"]
