"""A torchrun worker stops when its agent dies (minddp.parallel.agent): the parent-death signal,
and the race where the agent died before the signal was armed. Real processes (fork), no torch."""

import os
import select
import signal
import time

import pytest

from minddp.parallel import agent

NOTE = "its checkpoints are whole"


def _as_worker(parent: int) -> None:
    """This (forked) process as torchrun's worker whose script saw `parent` first."""
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    os.environ["RANK"] = "1"
    os.environ[agent.PARENT_ENV] = f"{os.getpid()}:{parent}"


def _read_until_eof(fd: int, timeout: float) -> tuple[str, float]:
    """What the other end wrote until every writer closed it (the process exited), and how long."""
    t0, out = time.monotonic(), b""
    while time.monotonic() - t0 < timeout:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                return out.decode(), time.monotonic() - t0
            out += chunk
    raise AssertionError(f"still running after {timeout} s; said so far: {out.decode()!r}")


@pytest.mark.skipif(not os.path.exists("/proc/self"), reason="Linux's prctl")
def test_the_worker_stops_with_one_line_when_its_parent_dies():
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the agent
        worker = os.fork()
        if worker == 0:
            os.dup2(w, 2)
            _as_worker(os.getppid())
            armed = agent.stop_with_agent(NOTE)
            os.write(w, b"armed\n" if armed else b"not armed\n")
            time.sleep(60)  # training, unsupervised, unless the signal comes
            os._exit(0)
        time.sleep(0.5)  # the worker arms its signal, then the agent dies (SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    os.close(w)
    try:
        said, took = _read_until_eof(r, timeout=20)
    finally:
        os.waitpid(middle, 0)
        os.close(r)
    assert said.startswith("armed\n"), said
    line = said.split("\n", 1)[1]
    assert line.count("\n") == 1 and line.startswith("[rank 1] minddp: stopped: torchrun's agent (pid "), line
    assert "is gone, and nothing would supervise this worker now; its checkpoints are whole" in line, line
    assert took < 10, took


@pytest.mark.skipif(not os.path.exists("/proc/self"), reason="Linux's prctl")
def test_a_worker_whose_main_thread_is_inside_cpp_stops_too():
    """A main thread blocked in C++ (the process group's start, waiting on a slow peer) never
    runs the signal's Python handler; here the signal is blocked in the main thread, as good as
    never handled there, and the worker must still stop within seconds."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the agent
        worker = os.fork()
        if worker == 0:
            os.dup2(w, 2)
            _as_worker(os.getppid())
            agent.stop_with_agent(NOTE)
            signal.pthread_sigmask(signal.SIG_BLOCK, {agent.SIGNAL})  # the main thread never sees it
            os.write(w, b"armed\n")
            time.sleep(60)
            os._exit(0)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    os.close(w)
    try:
        said, took = _read_until_eof(r, timeout=20)
    finally:
        os.waitpid(middle, 0)
        os.close(r)
    assert said.startswith("armed\n[rank 1] minddp: stopped: torchrun's agent (pid "), said
    assert took < 5, took


def test_an_agent_that_died_before_the_signal_was_armed_stops_the_worker_at_once():
    """The race: the script saw one parent, and by the time it arms the signal it has another."""
    r, w = os.pipe()
    worker = os.fork()
    if worker == 0:
        os.dup2(w, 2)
        _as_worker(parent=os.getppid() + 10**6)  # not the parent it has now
        agent.stop_with_agent()
        os.write(w, b"still running\n")
        os._exit(0)
    os.close(w)
    said, _ = _read_until_eof(r, timeout=20)
    _, status = os.waitpid(worker, 0)
    os.close(r)
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP and "still running" not in said, said
    assert said.startswith(f"[rank 1] minddp: stopped: torchrun's agent (pid {os.getpid() + 10**6}) is gone")


def test_outside_torchrun_nothing_is_armed(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert agent.stop_with_agent() is False


def test_a_child_does_not_take_its_parents_first_parent(monkeypatch):
    """The variable is inherited: it counts only for the pid that wrote it."""
    monkeypatch.setenv(agent.PARENT_ENV, f"{os.getpid() + 1}:12345")
    assert agent.first_parent() == os.getppid()
    monkeypatch.setenv(agent.PARENT_ENV, f"{os.getpid()}:12345")
    assert agent.first_parent() == 12345
