"""Killing only torchrun's agent (SIGKILL) stops its workers within seconds, each saying why
(issue 50.6: before, they trained on unsupervised until max_steps)."""

import os
import signal
import subprocess
import time

import pytest

from minddp.train.launch import workers
from tests.conftest import ROOT, SMALL
from tests.launch import env_for, torchrun, wait_for_step


def _alive(pid: int) -> bool:
    """Running (a zombie left for a reaper that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigkill_of_the_agent_alone_stops_both_workers_within_seconds(tmp_path):
    run = tmp_path / "run"
    args = [*SMALL, "train.max_steps=100000", "train.eval_every=0", "train.ckpt_every=0"]
    agent = subprocess.Popen(torchrun(2, ROOT / "train.py", *args), cwd=ROOT, env=env_for(run),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = []
    try:
        wait_for_step(run, 2, timeout=120)
        ranks = workers(agent.pid)
        assert len(ranks) == 2, ranks
        agent.kill()  # the agent only: its workers are in sessions of their own
        agent.wait()
        t0 = time.monotonic()
        # the workers hold the pipe's other end: its end of file comes as the last of them exits
        out, _ = agent.communicate(timeout=60)
        while any(_alive(pid) for pid in ranks) and time.monotonic() - t0 < 60:
            time.sleep(0.02)  # closing its files is not yet the end of an exit (a loaded machine)
        took = time.monotonic() - t0
        assert not any(_alive(pid) for pid in ranks), ranks
    finally:
        for pid in ranks:  # never leave a worker training (the old behaviour)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    said = sorted(line for line in out.splitlines() if "minddp: stopped: torchrun's agent" in line)
    assert [line[:8] for line in said] == ["[rank 0]", "[rank 1]"], out[-3000:]
    assert all(f"(pid {agent.pid}) is gone" in line and "train.resume=auto" in line for line in said), said
    print(f"workers gone {took:.1f} s after the agent's SIGKILL")
    assert took < 15, took


WAITING_ALONE = """import os, runpy, sys
os.environ["WORLD_SIZE"] = "2"  # a peer that never comes, as a slow one: init_process_group waits
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_worker_waiting_in_init_process_group_stops_with_its_agent(tmp_path):
    """issue 56.3: the worker waited inside init_process_group (its store held by rank 0 itself,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as the Makefile sets) until train.init_timeout_s, 600 s."""
    wrapper = tmp_path / "waiting_alone.py"
    wrapper.write_text(WAITING_ALONE)
    run = tmp_path / "run"
    env = env_for(run, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agent = subprocess.Popen(torchrun(1, wrapper, ROOT / "train.py", *SMALL), cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while not (ranks and run.is_dir()) and time.monotonic() < deadline:  # Hydra made the run dir:
            ranks = workers(agent.pid)  # the Trainer is a second from init_process_group
            time.sleep(0.1)
        time.sleep(4)  # inside init_process_group, where it waits up to train.init_timeout_s
        assert ranks and all(_alive(pid) for pid in ranks), ranks
        agent.kill()
        agent.wait()
        t0 = time.monotonic()
        out, _ = agent.communicate(timeout=60)
        while any(_alive(pid) for pid in ranks) and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert not any(_alive(pid) for pid in ranks), ranks
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "[rank 0] minddp: stopped: torchrun's agent" in out, out[-3000:]
    assert took < 5, took
