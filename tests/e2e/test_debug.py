"""Never hang, never lose work: fingerprints, flight recorder, consistency, bad input."""


import os
import re
import subprocess

import pytest
import torch

from minddp.train import checkpoint
from tests.conftest import SMALL, assert_same_curves, final_model, metrics
from tests.launch import run_train

# ------------------------------------------------------- end to end (slow)
ARGS = [*SMALL, "train.max_steps=6", "train.ckpt_every=2"]


@pytest.mark.slow
def test_truncated_checkpoint_is_named_and_the_previous_one_used(tmp_path):
    run_train(tmp_path / "run", *ARGS, "train.ckpt_format=file", "train.stop_at_step=4")
    first = metrics(tmp_path / "run")  # steps 1-4: the reference for steps 3 and 4 done again
    ckpt = tmp_path / "run" / "checkpoints" / "ckpt_00000004.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated on disk
    p = run_train(tmp_path / "run", *ARGS, "train.ckpt_format=file", "train.resume=auto")
    assert f"checkpoint {ckpt} is unreadable" in p.stdout + p.stderr
    assert "resumed from" in p.stdout + p.stderr and "ckpt_00000002.pt" in p.stdout + p.stderr
    again = metrics(tmp_path / "run")
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    assert_same_curves(again[:4], first, atol=1e-6)  # from step 2's checkpoint, the same steps 3 and 4
    # an explicit path to a broken checkpoint is refused, clearly, with exit code 2
    ckpt.write_bytes(b"garbage")
    p = run_train(tmp_path / "x", *ARGS, "train.ckpt_format=file", f"train.resume={ckpt}", check=False)
    assert p.returncode == 2 and "unreadable (truncated or corrupt)" in p.stderr


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(tmp_path):
    run_train(tmp_path / "run", *ARGS, "train.max_steps=2")
    p = run_train(tmp_path / "run", *ARGS, "train.resume=auto", "model.n_embd=32", check=False)
    assert p.returncode == 2 and "model.n_embd: 64 -> 32" in p.stderr  # the config check, first
    p = run_train(tmp_path / "run", *ARGS, "train.resume=auto", "model.n_embd=32", "train.resume_force=true",
                  check=False)
    assert p.returncode == 2 and "was written by a different model" in p.stderr


@pytest.mark.slow
def test_missing_data_path_and_partial_env_fail_fast(tmp_path):
    p = run_train(tmp_path / "x", "data=text", "data.path=/no/such/dir", "wandb.mode=disabled", check=False)
    assert p.returncode == 2 and "data.path='/no/such/dir' does not exist" in p.stderr
    p = run_train(tmp_path / "y", *ARGS, check=False, env={"RANK": "0"})
    assert p.returncode == 2 and "LOCAL_RANK, WORLD_SIZE not set" in p.stderr


@pytest.mark.slow
def test_nan_on_one_rank_makes_every_rank_skip_together(tmp_path):
    run_train(tmp_path / "run", *ARGS, "train.fault_nan_step=3", "train.fault_nan_rank=1",
              "train.check_every=1", nproc=2)
    rows = metrics(tmp_path / "run")
    assert rows[2]["loss"] is None and rows[2]["skipped_steps"] == 1  # NaN, logged as null
    assert all(r["loss"] is not None for r in rows[3:])  # replicas stayed equal: checked every step
    p = run_train(tmp_path / "stop", *ARGS, "train.fault_nan_step=3", "train.on_nonfinite=stop",
                  nproc=2, check=False)
    assert p.returncodes == [1, 1], p.stderr[-3000:]  # every rank stops, with the error
    for rank in (0, 1):
        assert f"[rank {rank}] minddp: FloatingPointError: non-finite loss or gradient at step 3" in p.stderr
    assert checkpoint.load(checkpoint.latest(tmp_path / "stop"), "cpu")["step"] == 2


@pytest.mark.slow
def test_debug_fingerprints_on_a_real_run(tmp_path):
    run_train(tmp_path / "on", *ARGS, "ddp.debug=true", nproc=2)
    run_train(tmp_path / "off", *ARGS, nproc=2)
    assert_same_curves(metrics(tmp_path / "on"), metrics(tmp_path / "off"), atol=0)
    a, b = final_model(tmp_path / "on"), final_model(tmp_path / "off")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_killed_rank_fails_the_job_fast_naming_it_and_leaves_a_loadable_checkpoint(tmp_path):
    import signal
    import time

    from tests.conftest import LONG
    from tests.launch import running_job, wait_for_step

    run_dir = tmp_path / "run"
    with running_job(run_dir, *LONG, "train.ckpt_every=1") as agent:
        wait_for_step(run_dir, 6, 120)
        workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True,
                                 text=True).stdout.split()
        t0 = time.monotonic()
        os.kill(int(workers[1]), signal.SIGKILL)  # mid-step, maybe mid-checkpoint
        out, _ = agent.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    assert agent.returncode != 0 and elapsed < 60, (elapsed, out[-3000:])
    # the dead rank, named: in torchrun's log line when it sees rank 1 first, else in its summary
    # (rank 0's own exit can be observed first)
    assert re.search(r"exitcode: -9\) local_rank: 1|local_rank: 1\)\s*exitcode\s*: -9", out), out[-3000:]
    state = checkpoint.load(checkpoint.latest(run_dir), "cpu")  # the newest checkpoint is whole
    assert state["step"] >= 5
