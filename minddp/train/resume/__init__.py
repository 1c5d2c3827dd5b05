"""Resuming a run:

    state.py        what a checkpoint holds of a run (model, optimizer, schedule, data position,
                    RNG) and how it comes back, at any dp/tp layout
    check.py        the saved configuration and data fingerprint against this run's: what is
                    refused, what is applied and listed
    command.py      the exact command that continues a stopped run

Which checkpoint is resumed from, and whether it fits this model: checkpoint/choice.py. The
names of the former minddp/train/resume.py are importable from here.
"""

from ..checkpoint.choice import shape_check
from .command import resume_command

__all__ = ["resume_command", "shape_check"]
