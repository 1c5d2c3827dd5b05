"""Measurements that run as jobs of their own (each bench-memory configuration, each scaling
run): the launch command, the environment, the first error line of one that failed, and which
commit of the engine was measured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


def launch(world: int, *target: str, torchrun: bool = True) -> list[str]:
    """`torchrun --standalone --nproc_per_node=world TARGET` (this Python's), or with
    `torchrun=False` at world 1 the target run by this Python directly."""
    if world == 1 and not torchrun:
        return [sys.executable, *target]
    torchrun_bin = str(Path(sys.executable).parent / "torchrun")
    return [torchrun_bin, "--standalone", f"--nproc_per_node={world}", *target]


def run_job(cmd: list[str], env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """The job, one thread per rank (OMP_NUM_THREADS=1), its output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def first_error(stderr: str) -> str:
    """The worker's exception line, not torchrun's summary banner."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip() and not set(x.strip()) <= set("=-")]
    hits = [x for x in lines if "Error" in x or "error:" in x]
    return (hits or lines[-1:] or ["no output"])[0][:200]


def engine_version() -> str:
    """The commit measured, and whether the engine had uncommitted changes (a shared tree)."""
    git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "minddp")
    return head + (" + uncommitted changes under minddp/" if dirty else "")
