"""Data x tensor parallelism end to end through the CLI."""


import pytest
from torch.testing import assert_close

from tests.conftest import SMALL, assert_same_curves, final_model, metrics
from tests.launch import run_train

pytestmark = pytest.mark.slow


ARGS = [*SMALL, "train.max_steps=5"]


def test_tp2_and_dp2_x_tp2_match_one_process(tmp_path):
    run_train(tmp_path / "one", *ARGS)
    run_train(tmp_path / "tp2", *ARGS, "mesh.tp=2", nproc=2)
    run_train(tmp_path / "dp2tp2", *ARGS, "mesh.tp=2", nproc=4)
    ref = metrics(tmp_path / "one")
    for d in ("tp2", "dp2tp2"):
        assert_same_curves(metrics(tmp_path / d), ref)
        got, want = final_model(tmp_path / d), final_model(tmp_path / "one")
        assert got.keys() == want.keys()
        for k in want:  # checkpoints hold the full (unsplit) tensors
            assert got[k].shape == want[k].shape
            # 3e-5, not 1e-5: AdamW divides by sqrt(v), so a near-zero gradient that a split
            # matmul rounds differently moves its weight by a fraction of lr (measured: one
            # element of 16384, 1.27e-5, reproducibly; everything else within 1e-5)
            assert_close(got[k], want[k], atol=3e-5, rtol=1e-4)


def test_checkpoint_saved_at_tp2_resumes_at_tp1(tmp_path):
    args = [*ARGS, "train.ckpt_every=1"]
    run_train(tmp_path / "ref", *args)
    run_train(tmp_path / "run", *args, "mesh.tp=2", "train.stop_at_step=3", nproc=2)
    run_train(tmp_path / "run", *args, "train.resume=auto")  # one process, tp=1
    assert_same_curves(metrics(tmp_path / "run"), metrics(tmp_path / "ref"))
    got, want = final_model(tmp_path / "run"), final_model(tmp_path / "ref")
    for k in want:
        assert_close(got[k], want[k], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("nproc,extra,message", [
    (3, ["mesh.tp=2"], "mesh.tp=2 does not divide the world size 3"),
    (2, ["mesh.tp=2", "model.n_head=3", "model.n_embd=48"], "mesh.tp=2 must divide model.n_head=3"),
    (2, ["mesh.tp=2", "model=mlp"], "mesh.tp=2 needs model=gpt"),
])
def test_bad_layouts_fail_fast_on_every_rank(tmp_path, nproc, extra, message):
    base = ["data=synthetic", "wandb.mode=disabled", "train.max_steps=2", "train.global_batch_size=16",
            "train.micro_batch_size=4"]
    p = run_train(tmp_path / "x", *base, *extra, nproc=nproc, check=False, timeout=120)
    assert p.returncodes == [2] * nproc, p.stderr[-3000:]
    for rank in range(nproc):
        assert f"[rank {rank}] minddp: configuration error: {message}" in p.stderr, p.stderr[-3000:]
