"""torchrun, ending a stopped run the way the README says: the resume command last, exit 0 after
SIGTERM (a checkpoint saved), 130 after Ctrl-C. What `make train NPROC=N` and slurm/ run:

    python -m minddp.train.launch --standalone --nproc_per_node=2 train.py [overrides]

Its arguments are torchrun's. A stop signal that reaches torchrun's agent makes it print a
30-line SignalException traceback and exit 1, burying the resume command the workers printed. So
torchrun runs in a session of its own (a terminal's Ctrl-C reaches this process only) and a
SIGTERM, SIGINT or SIGUSR1 here goes to the workers alone: they finish the step, checkpoint,
print the resume command and exit. A Ctrl-C reaches them as SIGTERM: a worker stopped by SIGINT
exits 130, and torchrun would print its 40-line ChildFailedError report of the "failed" workers;
after SIGTERM they exit 0 and torchrun does too. Once torchrun is done, the resume command the
run wrote to <run dir>/train.log is printed again, last, and this process exits 130 for Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .config import default_run_dir

# what the trainer's stop handler does with each signal, and the exit code the README gives
STOP_EXIT = {signal.SIGTERM: 0, signal.SIGUSR1: 0, signal.SIGINT: 130}


def workers(agent_pid: int) -> list[int]:
    """The agent's child processes (torchrun's workers), from Linux's /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if parent == agent_pid:
            found.append(int(stat.parent.name))
    return found


def resume_line(train_log: Path, since: float) -> str | None:
    """The last resume command train.log holds, if this launch wrote it."""
    try:
        if train_log.stat().st_mtime < since:
            return None
        lines = train_log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    at = [i for i, line in enumerate(lines) if line.endswith("resume with:") and i + 1 < len(lines)]
    return lines[at[-1] + 1].strip() if at else None


def resume_of(argv: list[str]) -> str | None:
    """The `train.resume=` override among torchrun's arguments (the script's come last)."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith(("train.resume=", "++train.resume="))]
    return given[-1] if given else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # decided here by the trainer's own rule, so this process knows where train.log will be
    run_dir = os.environ["MINDDP_RUN_DIR"] = default_run_dir(resume=resume_of(argv))
    started, stops = time.time(), []
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv], start_new_session=True)

    def to_workers(sig, _frame) -> None:
        stops.append(sig)
        for pid in workers(agent.pid):
            try:
                os.kill(pid, signal.SIGTERM if sig == signal.SIGINT else sig)  # exit 0: torchrun stays quiet
            except ProcessLookupError:
                pass

    for sig in STOP_EXIT:
        signal.signal(sig, to_workers)
    code = agent.wait()
    resume = resume_line(Path(run_dir) / "train.log", started) if stops else None
    if resume is None:
        return code
    sys.stdout.flush()
    sys.stderr.write(f"minddp: stopped by {signal.Signals(stops[0]).name}, checkpoint saved; resume with:\n"
                     f"  {resume}\n")
    return STOP_EXIT[stops[0]]


if __name__ == "__main__":
    sys.exit(main())
