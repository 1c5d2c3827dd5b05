"""Issue 45.2 and 45.3 on real runs: a diverged run says so in summary.json, W&B's summary and
`minddp report`; a weak-scaling run resumed on another world size is refused unless forced."""

import json

import pytest

from minddp.tools import report
from tests.conftest import SMALL, metrics
from tests.launch import run_train
from tests.wandb_offline import runs_under

pytestmark = pytest.mark.slow


def test_a_diverged_run_is_summarised_as_diverged(tmp_path):
    run = tmp_path / "run"
    p = run_train(run, *SMALL, "optim.lr=1e30", "train.max_steps=15", "wandb.mode=offline", check=False)
    assert p.returncode == 3, p.stderr[-3000:]
    rows = metrics(run)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["loss"], summary["skipped_steps"]) == ("non-finite", None, 10)
    assert rows[-1]["loss"] is None and summary["last_finite_loss"] == rows[0]["loss"]
    (w,) = runs_under(run / "wandb")
    assert (w["summary"]["status"], w["summary"]["skipped_steps"]) == ("non-finite", 10)
    head, table = report.table_rows([report.load_run(run) | {"efficiency": None}], [])
    cells = dict(zip(head, table[0]))
    assert (cells["status"], cells["loss"]) == ("non-finite (10 skipped)", "-")


WEAK = [*SMALL, "train.scaling=weak", "train.global_batch_size=8", "train.eval_every=0"]


def test_weak_scaling_resumed_on_another_world_size_is_refused_unless_forced(tmp_path):
    run = tmp_path / "run"
    run_train(run, *WEAK, "train.max_steps=4", nproc=2)
    p = run_train(run, *WEAK, "train.resume=auto", "train.max_steps=8", check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "the global batch: 16 -> 8 samples per step (train.scaling=weak" in p.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]  # refused before anything was written
    p = run_train(run, *WEAK, "train.resume=auto", "train.max_steps=6", "train.resume_force=true")
    assert "changed on resume (train.resume_force=true): the global batch: 16 -> 8" in p.stdout + p.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]  # forced: it goes on, the change listed
