"""ZeRO-1 (minddp.ShardedOptimizer) against the unsharded engine, on real gloo processes."""


import pytest
import torch

# ----------------------------------------------------------- through train.py
from tests.conftest import SMALL, assert_same_curves, final_model, metrics  # noqa: E402
from tests.launch import run_train  # noqa: E402


def _same_model(a, b, atol=1e-5):
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [3])  # 2 ranks through train.py: the checkpoint test below
def test_train_py_with_and_without_sharding_gives_the_same_run(tmp_path, nproc):
    args = [*SMALL, "train.global_batch_size=24", "train.max_steps=5", "optim.grad_clip=0.5"]
    run_train(tmp_path / "plain", *args, nproc=nproc)
    run_train(tmp_path / "zero", *args, "ddp.shard_optimizer=true", nproc=nproc)
    assert_same_curves(metrics(tmp_path / "zero"), metrics(tmp_path / "plain"), atol=1e-5)
    rows = [r for r in metrics(tmp_path / "zero") if "loss" in r]
    assert all(0 <= r["comm/exposed_gather_s"] < r["step_time_s"] for r in rows)  # ZeRO-1's own row
    assert not any("comm/exposed_gather_s" in r for r in metrics(tmp_path / "plain"))
    _same_model(final_model(tmp_path / "zero"), final_model(tmp_path / "plain"))


@pytest.mark.slow
def test_checkpoints_move_between_sharded_and_unsharded_at_any_dp(tmp_path):
    args = [*SMALL, "train.max_steps=6", "train.ckpt_every=3", "train.eval_every=0"]
    run_train(tmp_path / "ref", *args, nproc=2)
    # sharded on 2 ranks -> unsharded on 1
    run_train(tmp_path / "a", *args, "ddp.shard_optimizer=true", "train.stop_at_step=3", nproc=2)
    run_train(tmp_path / "a", *args, "train.resume=auto", nproc=1)
    # unsharded on 1 rank -> sharded on 2
    run_train(tmp_path / "b", *args, "train.stop_at_step=3", nproc=1)
    run_train(tmp_path / "b", *args, "ddp.shard_optimizer=true", "train.resume=auto", nproc=2)
    for run in ("a", "b"):
        assert_same_curves(metrics(tmp_path / run), metrics(tmp_path / "ref"), atol=1e-5)
        _same_model(final_model(tmp_path / run), final_model(tmp_path / "ref"))


@pytest.mark.slow
def test_sharding_composes_with_tensor_parallelism(tmp_path):
    args = [*SMALL, "train.max_steps=4", "mesh.tp=2"]
    run_train(tmp_path / "plain", *args, nproc=4)
    run_train(tmp_path / "zero", *args, "ddp.shard_optimizer=true", nproc=4)
    assert_same_curves(metrics(tmp_path / "zero"), metrics(tmp_path / "plain"), atol=1e-5)
    _same_model(final_model(tmp_path / "zero"), final_model(tmp_path / "plain"), atol=3e-5)
