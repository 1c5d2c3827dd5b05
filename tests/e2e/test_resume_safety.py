"""Never lose a run: resume that cannot lose progress, what a crash leaves behind, the
configuration a resume may change, and settings that are NaN or inf (issue 22)."""


import pytest
import torch

from minddp.train import checkpoint
from minddp.train.config import register
from tests.conftest import SMALL, compose_config, metrics
from tests.files import TINY_STATE, save_file, small_disk, snapshot
from tests.launch import run_train

register()


@pytest.mark.slow  # it runs mount(8); about a second
def test_a_real_full_disk_is_a_checkpoint_write_error_and_the_previous_one_stays(tmp_path):
    with small_disk(tmp_path / "small", 4) as mnt:
        save_file(mnt, 1, {**TINY_STATE, "step": 1})
        with pytest.raises(checkpoint.CheckpointWriteError, match=r"MiB free in .*small/checkpoints"):
            save_file(mnt, 2, {**TINY_STATE, "model": {"w": torch.ones(2**20)}, "step": 2})  # 4 MiB
        assert [q.name for q in (mnt / "checkpoints").iterdir()] == ["ckpt_00000001.pt"]
        assert checkpoint.load(checkpoint.latest(mnt), "cpu")["step"] == 1


# ------------------------------------------------------------ end to end (slow)
ARGS = [*SMALL, "train.max_steps=6", "train.ckpt_every=2"]
FILES = [*ARGS, "train.ckpt_format=file"]  # for the tests that damage a checkpoint file's bytes


@pytest.mark.slow
@pytest.mark.parametrize("override,message", [
    ("bogus.key=1", "unknown key bogus.key (there is model, data, optim, seed, train, ddp, mesh, wandb)"),
    ("train.max_steps=abc", "train.max_steps: Value 'abc' of type 'str' could not be converted to Integer"),
])
def test_hydras_own_errors_exit_2_in_one_line(tmp_path, override, message):
    p = run_train(tmp_path / "x", *SMALL, override, check=False, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stderr.startswith(f"[rank 0] minddp: configuration error: {message}"), p.stderr[-2000:]
    assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr


@pytest.mark.slow
def test_all_checkpoints_unreadable_exits_2_on_every_rank_naming_them(tmp_path):
    run = tmp_path / "run"
    run_train(run, *FILES, "train.stop_at_step=4", nproc=2)
    paths = checkpoint.all_checkpoints(run)
    assert len(paths) == 2
    for p in paths:
        p.write_bytes(p.read_bytes()[:500])
    before, rows = snapshot(paths), metrics(run)
    p = run_train(run, *FILES, "train.resume=auto", nproc=2, check=False, timeout=120)
    assert p.returncodes == [2, 2], p.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] minddp: configuration error:" in p.stderr, p.stderr[-3000:]
    assert all(str(path) in p.stderr for path in paths)
    assert snapshot(paths) == before and metrics(run) == rows
    assert sorted(checkpoint.checkpoint_dir(run).iterdir()) == sorted(paths)


@pytest.mark.slow
def test_a_transient_read_error_stops_every_rank_without_falling_back(tmp_path):
    run = tmp_path / "run"
    run_train(run, *FILES, "train.stop_at_step=4", nproc=2)
    newest = checkpoint.latest(run)
    data = newest.read_bytes()
    newest.unlink()
    newest.symlink_to("/proc/self/mem")  # reading it is a real I/O error (EIO)
    p = run_train(run, *FILES, "train.resume=auto", nproc=2, check=False, timeout=120)
    assert p.returncode != 0 and 2 not in p.returncodes, p.stderr[-3000:]  # not a config error
    assert "[rank 0] minddp: CheckpointReadError: could not read checkpoint" in p.stderr
    assert "[rank 1] minddp: CheckpointReadError: rank 0 could not resume" in p.stderr
    assert "resumed from" not in p.stdout + p.stderr
    newest.unlink()
    newest.write_bytes(data)
    assert [q.name for q in checkpoint.all_checkpoints(run)] == ["ckpt_00000004.pt", "ckpt_00000002.pt"]


@pytest.mark.slow
def test_resume_refuses_a_new_seed_and_applies_a_new_lr(tmp_path):
    run = tmp_path / "run"
    run_train(run, *ARGS, "train.stop_at_step=2", nproc=2)
    p = run_train(run, *ARGS, "train.resume=auto", "seed=7", "model.n_embd=32", nproc=2, check=False,
                  timeout=120)
    assert p.returncodes == [2, 2], p.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] minddp: configuration error: resuming from" in p.stderr
    assert "seed: 1337 -> 7" in p.stderr and "model.n_embd: 64 -> 32" in p.stderr
    # a new optim.lr and max_steps: applied (the schedule is this run's), and listed
    p = run_train(run, *ARGS, "train.resume=auto", "optim.lr=0.003", "train.max_steps=8")
    assert "changed on resume, applied: optim.lr: 0.001 -> 0.003" in p.stdout + p.stderr
    from minddp.train.trainer import lr_factor

    new, got = compose_config(*ARGS, "optim.lr=0.003").optim, metrics(run)
    assert [r["step"] for r in got] == list(range(1, 9))
    for a in got[2:]:  # from the resumed step on: the new schedule (lr 0.003 over 8 steps), exactly
        assert a["lr"] == pytest.approx(0.003 * lr_factor(a["step"], new, 8), rel=1e-12, abs=0), a
    # and resume_force=true takes a refused change, listing it
    p = run_train(run, *ARGS, "train.resume=auto", "seed=7", "train.max_steps=9",
                  "train.resume_force=true", "optim.lr=0.003")
    assert "changed on resume (train.resume_force=true): seed: 1337 -> 7" in p.stdout + p.stderr
