"""train.compile=whole|blocks|none: the trainer compiles its model in place (inductor), on 2 ranks."""

import pytest
from torch.testing import assert_close

from tests.conftest import SMALL, final_model, metrics
from tests.launch import run_train

pytestmark = pytest.mark.slow


def test_compiled_runs_learn_like_eager_and_keep_the_checkpoint_names(tmp_path):
    steps = [*SMALL, "train.max_steps=3", "train.eval_every=0"]
    run_train(tmp_path / "none", *steps, nproc=2)
    for how in ("whole", "blocks"):
        run_train(tmp_path / how, *steps, f"train.compile={how}", nproc=2, timeout=400)
    eager = metrics(tmp_path / "none")
    ref = final_model(tmp_path / "none")
    for how in ("whole", "blocks"):
        run = metrics(tmp_path / how)
        assert_close([r["loss"] for r in run], [r["loss"] for r in eager], atol=1e-4, rtol=1e-4)
        got = final_model(tmp_path / how)
        assert got.keys() == ref.keys()  # compiled in place: no _orig_mod. in the checkpoint
        for k in ref:
            assert_close(got[k], ref[k], atol=1e-4, rtol=1e-3)


def test_an_unknown_compile_mode_is_refused_before_training(tmp_path):
    p = run_train(tmp_path / "bad", *SMALL, "train.compile=model", nproc=1, check=False)
    assert p.returncode != 0
    assert "compile" in p.stderr and "whole" in p.stderr
