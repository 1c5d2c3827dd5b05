"""Retention and the new defaults on real runs: the checkpoints a run keeps are exactly what its
start-up line says, across a resume; a run saved by an earlier version (files, every checkpoint
kept) resumes under the new defaults (folders, the newest 3) bitwise; a negative train.ckpt_keep
is one line and exit 2 on every rank; the run's end says what its checkpoints take on disk."""

from pathlib import Path

import pytest
import torch

from minddp.train import checkpoint
from tests.conftest import SMALL, final_model, metrics
from tests.launch import run_train

ARGS = [*SMALL, "train.max_steps=10", "train.ckpt_every=1", "train.eval_every=0"]
OLD_DEFAULTS = ["train.ckpt_format=file", "train.ckpt_async=false", "train.ckpt_keep=0"]  # minddp 0.5


def _names(run):
    return [p.name for p in checkpoint.all_checkpoints(run)]


def _equal(a, b):
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


@pytest.mark.slow
def test_retention_keeps_exactly_what_it_says_across_a_resume(tmp_path):
    keep = ["train.ckpt_keep=2", "train.ckpt_keep_every=3"]
    run_train(tmp_path / "ref", *ARGS, "train.ckpt_keep=1", nproc=2)
    p = run_train(tmp_path / "run", *ARGS, *keep, "train.stop_at_step=5", nproc=2)
    out = p.stdout + p.stderr
    assert ("keeping the newest 2 (train.ckpt_keep) and those at steps divisible by 3 (train.ckpt_keep_every)"
            in out), out[-3000:]
    assert _names(tmp_path / "run") == ["ckpt_00000005", "ckpt_00000004", "ckpt_00000003"]
    assert "removed ckpt_00000002 (keeping the newest 2" in out
    p = run_train(tmp_path / "run", *ARGS, *keep, "train.resume=auto", nproc=2)
    assert _names(tmp_path / "run") == ["ckpt_00000010", "ckpt_00000009", "ckpt_00000006", "ckpt_00000003"]
    assert not list(checkpoint.checkpoint_dir(tmp_path / "run").glob(".*"))
    mib = checkpoint.disk_bytes(tmp_path / "run") / 2**20
    end = [line for line in (p.stdout + p.stderr).splitlines() if "MiB on disk" in line]
    said = f"checkpoints: 4 in {tmp_path / 'run' / 'checkpoints'} (steps 10, 9, 6, 3), {mib:.1f} MiB"
    assert end and said in end[-1], end
    _equal(final_model(tmp_path / "run"), final_model(tmp_path / "ref"))  # retention touches no state
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in metrics(tmp_path / "ref")]


@pytest.mark.slow
def test_a_run_saved_with_the_old_defaults_resumes_under_the_new_ones(tmp_path):
    """0.5's defaults (one file per step, every one kept) stopped at 4; resumed with today's
    (folders, the newest 3, async off on the CPU) from the file on 2 ranks, then on 1: the end
    of an uninterrupted run of the old defaults (to float tolerance: dp 1 sums in another
    order); the old files go as newer folders are saved."""
    run_train(tmp_path / "ref", *ARGS, *OLD_DEFAULTS, nproc=2)
    run_train(tmp_path / "run", *ARGS, *OLD_DEFAULTS, "train.stop_at_step=4", nproc=2)
    assert _names(tmp_path / "run")[:2] == ["ckpt_00000004.pt", "ckpt_00000003.pt"]
    p = run_train(tmp_path / "run", *ARGS, "train.stop_at_step=5", "train.resume=auto", nproc=2)
    old_file = tmp_path / "run" / "checkpoints" / "ckpt_00000004.pt"
    assert f"resumed from {old_file} at step 4" in p.stdout + p.stderr
    assert _names(tmp_path / "run") == ["ckpt_00000005", "ckpt_00000004.pt", "ckpt_00000003.pt"]
    run_train(tmp_path / "run", *ARGS, "train.resume=auto", nproc=1)  # and on another dp size
    assert _names(tmp_path / "run") == ["ckpt_00000010", "ckpt_00000009", "ckpt_00000008"]
    ref, got = final_model(tmp_path / "ref"), final_model(tmp_path / "run")
    for k in ref:  # dp 2 -> 1: the same samples per step, summed in another order
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-4)
    assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(1, 11))


@pytest.mark.slow
def test_a_negative_ckpt_keep_is_one_line_and_exit_2_on_every_rank(tmp_path):
    p = run_train(tmp_path / "run", *ARGS, "train.ckpt_keep=-1", nproc=2, check=False, timeout=120)
    assert p.returncodes == [2, 2], p.stderr[-3000:]
    for rank in (0, 1):
        assert (f"[rank {rank}] minddp: configuration error: train.ckpt_keep=-1 must be >= 0" in p.stderr), \
            p.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_diverged_resume_keeps_the_way_back(tmp_path):
    """Issue 56.2: a healthy run (a checkpoint every 2 steps, the newest 3 kept) resumed with
    optim.lr=1e30 diverges at once: every step after the first is skipped until the guard stops
    the run (exit 3). Its saves during the streak take no slot, so the checkpoints from before it
    stay, and the guard's advice (resume from an earlier checkpoint) is one command that works."""
    args = [*SMALL, "train.max_steps=30", "train.ckpt_every=2", "train.eval_every=0",
            "train.max_skipped_steps=6"]
    run = tmp_path / "run"
    run_train(run, *args, "train.stop_at_step=10")
    assert _names(run) == ["ckpt_00000010", "ckpt_00000008", "ckpt_00000006"]
    p = run_train(run, *args, "train.resume=auto", "optim.lr=1e30", check=False)
    assert p.returncode == 3, (p.stdout + p.stderr)[-3000:]
    assert "6 steps in a row (12..17) had a non-finite loss or gradient" in p.stderr, p.stderr[-3000:]
    assert _names(run) == ["ckpt_00000016", "ckpt_00000014", "ckpt_00000012", "ckpt_00000010",
                           "ckpt_00000008", "ckpt_00000006"]
    back = run / "checkpoints" / "ckpt_00000010"
    p = run_train(run, *args, f"train.resume={back}", "train.stop_at_step=12")
    assert f"resumed from {back} at step 10" in p.stdout + p.stderr


@pytest.mark.slow
def test_a_keep_every_that_divides_ckpt_every_is_said_at_start_up(tmp_path):
    p = run_train(tmp_path / "run", *ARGS, "train.max_steps=2", "train.ckpt_keep_every=1")
    assert ("train.ckpt_keep_every=1 divides train.ckpt_every=1: every checkpoint is a milestone kept "
            "forever, so train.ckpt_keep=3 deletes none") in p.stdout + p.stderr


@pytest.mark.slow
def test_a_read_only_checkpoints_folder_stops_the_run_at_start_up(tmp_path, request):
    """Issue 56.11: found only at the first save before. As an unprivileged user (root writes
    anywhere): the run dir is theirs, its checkpoints/ is not; one line, exit 2. (Every rank
    checks and the verdict is agreed: tests/dist/test_retention_rank0.py.)"""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.conftest import ROOT, as_nobody

    base = Path(tempfile.mkdtemp(dir=tmp_path.anchor + "tmp"))  # pytest's is private to its user
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    os.chmod(base, 0o755)
    run = base / "run"
    (run / "checkpoints").mkdir(parents=True)
    os.chown(run, 65534, 65534)
    env = {**os.environ, "HOME": str(base), "MINDDP_RUN_DIR": str(run), "OMP_NUM_THREADS": "1"}
    cmd = as_nobody([sys.executable, str(ROOT / "train.py"), *ARGS, "train.resume=auto"])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=base, timeout=180)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    said = f"configuration error: cannot write checkpoints in {run / 'checkpoints'} (Permission denied)"
    assert said in p.stderr and "make it writable" in p.stderr, p.stderr[-3000:]
    assert "step 1" not in p.stdout + p.stderr  # refused before training
