"""Resuming a run, as the command line sees it:

    check.py        the saved configuration and data fingerprint against this run's: what is
                    refused, what is applied and listed
    command.py      the exact command that continues a stopped run

Which checkpoint is resumed from, what it holds and how it comes back: checkpoint/ (manager.py,
choice.py, state.py). The names of the former minddp/train/resume.py are importable from here.
"""

from ..checkpoint.choice import shape_check
from .command import resume_command

__all__ = ["resume_command", "shape_check"]
