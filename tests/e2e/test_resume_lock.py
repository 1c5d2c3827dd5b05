"""Issue 45.1: one live job per run directory. Real jobs: a live torchrun job holds the run dir;
a second job in it (a requeue that overlaps it, or a fresh job of a mis-set array) is refused
on every rank with one line naming the holder, exit 2, and the live job's files stay whole; a
holder killed with kill -9 never blocks its requeue."""

import os
import re
import signal
import socket
from pathlib import Path

import pytest

from tests.conftest import LONG, metrics
from tests.launch import run_train, running_job, wait_for_step

pytestmark = pytest.mark.slow


def holder_pid(run: Path) -> int:
    return int(re.search(r"pid (\d+)", (run / ".lock").read_text()).group(1))


@pytest.mark.parametrize("second", [
    ("train.resume=auto", "train.max_steps=150"),  # a requeue overlapping the running job
    ("seed=2", "train.max_steps=150"),  # a fresh job of an array that shares MINDDP_RUN_DIR
], ids=["requeue", "fresh"])
def test_a_second_job_in_a_live_run_dir_is_refused_on_every_rank(tmp_path, second):
    run = tmp_path / "run"
    with running_job(run, *LONG, "train.max_steps=1000") as agent:
        wait_for_step(run, 2, timeout=120)
        record = {f.name: f.read_bytes() for f in (run / ".hydra").iterdir()}
        p = run_train(run, *LONG, *second, nproc=2, check=False, timeout=120)
        assert {f.name: f.read_bytes() for f in (run / ".hydra").iterdir()} == record  # the live job's
        assert p.returncodes == [2, 2], p.stderr[-3000:]
        holder = (f"the run dir {run} is in use by another live job (host {socket.gethostname()}, "
                  f"pid {holder_pid(run)}, torchrun run id ")
        for rank in (0, 1):
            line = next(x for x in p.stderr.splitlines() if x.startswith(f"[rank {rank}] minddp: "))
            assert line.startswith(f"[rank {rank}] minddp: configuration error: ") and holder in line, line
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
        assert agent.poll() is None  # the live job goes on
        at = len(metrics(run))
        wait_for_step(run, at + 2, timeout=120)
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=120)
    assert "resume with" in out, out[-3000:]  # the live job checkpointed and stopped as asked
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(1, len(steps) + 1))  # nothing replaced, nothing interleaved


def test_a_holder_killed_with_sigkill_does_not_block_its_requeue(tmp_path):
    run = tmp_path / "run"
    with running_job(run, *LONG, "train.max_steps=1000") as agent:
        wait_for_step(run, 6, timeout=120)  # past the checkpoint at step 5
        os.kill(holder_pid(run), signal.SIGKILL)
        agent.communicate(timeout=120)  # torchrun ends the other rank and fails
    assert agent.returncode != 0
    p = run_train(run, *LONG, "train.resume=auto", "train.max_steps=12", nproc=2, timeout=120)
    assert "in use" not in p.stderr
    assert metrics(run)[-1]["step"] == 12
