"""A background save (train.ckpt_async) ends cleanly on every way out of a run: an error that
meets it in flight (a NaN stop, a diverged run) leaves with the run's own exit code, never
SIGABRT (134, -6 per torchrun worker); the checkpoint is either completed and committed or
removed, and the closing line says which. Real torchrun jobs: the abort came from the
interpreter's teardown, which forked ranks skip."""

import re

import pytest

from minddp.train import checkpoint
from tests.conftest import SMALL
from tests.launch import run_train

ARGS = [*SMALL, "train.max_steps=8", "train.eval_every=0", "train.ckpt_format=dcp", "train.ckpt_async=true",
        "train.ckpt_every=2", "ddp.shard_optimizer=true"]
# rank 1's background write of step 2's checkpoint sleeps first: rank 0's waits for it inside DCP's
# collective while both main threads go on into step 3, where the run stops with an error
SLOW_WRITE = ["train.fault_sleep_in=checkpoint_write", "train.fault_sleep_step=2", "train.fault_sleep_rank=1",
              "train.fault_sleep_s=4"]


def _worker_codes(out: str) -> list[str]:
    """torchrun's failure summary: each failed worker's `exitcode  : N`."""
    return re.findall(r"exitcode\s+:\s*(-?\d+)", out)


@pytest.mark.slow
@pytest.mark.parametrize("stop, code", [
    (["train.on_nonfinite=stop", "train.fault_nan_step=3"], 1),  # FloatingPointError
    (["train.fault_nan_step=3", "train.max_skipped_steps=1"], 3),  # skipped, "diverged": exit 3
], ids=["nan-stop", "diverged"])
def test_an_error_during_a_background_save_exits_with_the_runs_code_and_commits_it(tmp_path, stop, code):
    run = tmp_path / "run"
    p = run_train(run, *ARGS, *SLOW_WRITE, *stop, nproc=2, launcher="torchrun", check=False, timeout=240)
    out = p.stdout + p.stderr
    codes = _worker_codes(out)
    assert "terminate called" not in out and "SIGABRT" not in out and "-6" not in codes, out[-4000:]
    assert p.returncode == 1 and codes and set(codes) <= {str(code), "-15"}, (codes, out[-4000:])
    assert str(code) in codes, (codes, out[-4000:])
    saved = checkpoint.all_checkpoints(run)
    assert [c.name for c in saved] == ["ckpt_00000002"], saved
    assert checkpoint.load(saved[0], "cpu")["step"] == 2
    assert not list(checkpoint.checkpoint_dir(run).glob(".ckpt_*")), "a temporary folder was left"
    assert f"written in the background when the run stopped: completed and committed as {saved[0]}" in out, \
        out[-4000:]


@pytest.mark.slow
def test_a_background_write_stuck_past_the_timeout_is_removed_and_the_exit_code_holds(tmp_path):
    """Rank 1's write sleeps past train.timeout_s: rank 0's write times out in DCP's collective
    (the write's group has the training's timeout), the folder is removed and said so, and both
    leave with the run's code (rank 1's write thread still asleep: no teardown to abort)."""
    run = tmp_path / "run"
    stuck = [*(a for a in SLOW_WRITE if "fault_sleep_s=" not in a), "train.fault_sleep_s=10",
             "train.timeout_s=2"]
    p = run_train(run, *ARGS, *stuck, "train.on_nonfinite=stop", "train.fault_nan_step=3", nproc=2,
                  launcher="torchrun", check=False, timeout=240)
    out = p.stdout + p.stderr
    assert _worker_codes(out) == ["1", "1"] and "terminate called" not in out, out[-4000:]
    said = "the checkpoint of step 2, written in the background when the run stopped: removed ("
    assert said in out and "Timed out" in out.split(said)[1].splitlines()[0], out[-4000:]
    assert checkpoint.all_checkpoints(run) == [] and not list(checkpoint.checkpoint_dir(run).glob(".*"))
