"""One live job per run directory: an OS lock on `<run dir>/.lock`, held for the run's life.

Two jobs writing one run dir (a Slurm requeue that overlaps the still-running job, a job
array with one MINDDP_RUN_DIR) would interleave metrics, checkpoints and summaries. The
lock is `fcntl.flock` on a file that is never replaced: the kernel drops it when the holder
exits, however it exits (kill -9 included), so a killed job never blocks its requeue. Only
rank 0 of a job takes it (ranks on other nodes share the folder, not the process); the
verdict reaches every rank through `together`, so every rank exits 2 with the same line.
The file holds the holder's host, pid and job id, for the refused job's message. On NFS
Linux maps flock to a byte-range lock the server enforces; Lustre needs `-o flock`.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from ...errors import ConfigError

NAME = ".lock"
_held: dict[str, int] = {}  # run dir (real path) -> this process's locked file descriptor


class RunDirInUse(ConfigError):
    """Another live job holds the run dir: exit 2, naming it."""


def holder() -> str:
    """Who this process is, as the next job will read it: host, pid, and the job's id."""
    env = os.environ
    parts = [f"host {socket.gethostname()}", f"pid {os.getpid()}"]
    if env.get("SLURM_ARRAY_JOB_ID"):
        parts.append(f"Slurm job {env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}")
    elif env.get("SLURM_JOB_ID"):
        parts.append(f"Slurm job {env['SLURM_JOB_ID']}")
    if env.get("TORCHELASTIC_RUN_ID"):
        parts.append(f"torchrun run id {env['TORCHELASTIC_RUN_ID']}")
    return ", ".join(parts)


def hold(run_dir) -> None:
    """Lock `run_dir` for this process's life, or raise RunDirInUse naming the holder. Taking
    it again in the process that holds it is a no-op (the trainer built twice in one test)."""
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(folder)
    if key in _held:
        return
    fd = os.open(folder / NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "holder not yet recorded"
        os.close(fd)
        raise RunDirInUse(
            f"the run dir {run_dir} is in use by another live job ({who}): one job per run directory. "
            "Wait for it to end (or stop it), or give this job its own MINDDP_RUN_DIR") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (holder() + "\n").encode(), 0)
    _held[key] = fd


def hold_agreed(run_dir, rank: int) -> None:
    """Rank 0 takes the lock; its verdict is every rank's (one collective, in seconds): a
    refused job exits 2 on every rank before it writes anything."""
    from ..safety.together import together

    error = None
    if rank == 0:
        try:
            hold(run_dir)
        except RunDirInUse as e:
            error = e
    together(error)
