"""A torchrun worker stops when its agent dies.

torchrun's agent (its parent process) starts each worker in a session of its own
(`start_new_session`), so when only the agent is killed (SIGKILL, the OOM killer) nothing reaches
the workers: they train on unsupervised, their exit codes read by no one, a restart by no one,
holding the GPUs a requeued job needs. Linux's parent-death signal (prctl PR_SET_PDEATHSIG)
makes the kernel signal the worker when its parent dies; the handler says why in one line and
leaves at once (`os._exit`: whatever waits on the agent's store, now gone, could hang).
Checkpoints are written atomically, so the last one is intact.

The signal is asked for only after the interpreter and its imports have started (seconds): an
agent that died in between left the worker with another parent already, and no signal would
come. So the parent is read first thing in the worker's script (`os.environ[PARENT_ENV]`,
train.py's first lines; a child process inherits the variable, so it names the pid that wrote
it) and compared once the signal is armed.

The signal's handler runs only when the main thread runs Python: a worker blocked in C++ with the
GIL released (init_process_group waiting on a slow peer's store, for up to train.init_timeout_s)
would never see it. A daemon thread that reads the parent every quarter second covers that.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PARENT_ENV = "MINDDP_WORKER_PARENT"  # "<pid>:<parent's pid>" as the worker's script first saw them
PR_SET_PDEATHSIG = 1  # linux/prctl.h
SIGNAL = signal.SIGHUP  # "the controlling process is gone"; torchrun's workers have no terminal
POLL_S = 0.25  # the watcher thread's period: "within a second" while the main thread is in C++


def stop_with_agent(note: str = "") -> bool:
    """Under torchrun on Linux: this worker stops (one line on stderr, exit 129) when the agent
    that started it dies, or now if it already has. `note` ends the line (e.g. how to resume).
    False (nothing armed) elsewhere."""
    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    agent = first_parent()
    stop = _stopper(agent, note)
    signal.signal(SIGNAL, stop)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(SIGNAL), 0, 0, 0) != 0:
        return False  # a kernel that refuses it: the worker runs as before
    if os.getppid() != agent:  # the agent died before the signal was armed: none will come
        stop(int(SIGNAL), None)
    threading.Thread(target=_watch, args=(agent, stop), name="minddp-agent-watch", daemon=True).start()
    return True


def _watch(agent: int, stop) -> None:
    """Stop the worker once its parent is no longer the agent, whatever the main thread is doing."""
    while os.getppid() == agent:
        time.sleep(POLL_S)
    stop(int(SIGNAL), None)


def first_parent() -> int:
    """The parent the script saw first (PARENT_ENV, when this process wrote it: a child inherits
    its parent's), else the parent now."""
    pid, _, parent = os.environ.get(PARENT_ENV, "").partition(":")
    return int(parent) if pid == str(os.getpid()) and parent.isdigit() else os.getppid()


def _stopper(agent: int, note: str):
    def stop(signum, _frame) -> None:
        if not _gone(agent):  # the thread that started this worker ended, the agent lives on
            return
        rank = os.environ.get("RANK", "?")
        line = (f"[rank {rank}] minddp: stopped: torchrun's agent (pid {agent}) is gone, and nothing "
                f"would supervise this worker now{f'; {note}' if note else ''}\n")
        os.write(2, line.encode())  # one write, safe inside a signal handler
        os._exit(128 + int(signum))

    return stop


def _gone(agent: int, wait_s: float = 3.0) -> bool:
    """Whether this process has another parent than the agent within `wait_s`. The signal comes
    when the agent's thread that started the worker exits; while the agent's other threads are
    still being torn down (a SIGKILL ends them one by one) the agent is still the parent, and a
    thread that ends in a living agent sends the signal too."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == agent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
