"""Issue 45.2 and 45.3 as pure functions: how a run ended (summary.ending: a run that stopped on
non-finite steps says so), and a weak-scaling resume on another world size (check_global_batch)."""

import pytest

from minddp.errors import ConfigError
from minddp.tools.report import ended
from minddp.train.metrics.summary import summary
from minddp.train.resume.check import check_saved


def rows_of(losses, skipped):
    return [{"step": s, "loss": loss, "step_time_s": 0.1, **({"skipped_steps": k} if k else {})}
            for s, (loss, k) in enumerate(zip(losses, skipped), 1)]


def test_a_run_that_stopped_on_non_finite_steps_says_so():
    s = summary(rows_of([5.5652, None, None, None], [0, 1, 2, 3]))  # metrics.jsonl writes NaN as null
    assert (s["status"], s["loss"], s["skipped_steps"]) == ("non-finite", None, 3)
    assert s["last_finite_loss"] == 5.5652  # the older finite loss, under its own name
    assert ended(s) == "non-finite (3 skipped)"  # minddp report's status column


def test_a_skipped_last_step_with_a_finite_loss_is_non_finite_too():
    """A non-finite gradient under a finite loss skips the step as well."""
    s = summary(rows_of([5.0, 4.0, 3.9], [0, 0, 1]))
    assert (s["status"], s["loss"], s["skipped_steps"]) == ("non-finite", 3.9, 1)


def test_a_run_that_skipped_and_recovered_is_ok_and_counts_its_skips():
    s = summary(rows_of([5.0, None, 4.0, 3.0], [0, 1, 1, 1]))
    assert (s["status"], s["loss"], s["skipped_steps"]) == ("ok", 3.0, 1)
    assert ended(summary(rows_of([5.0, 4.0], [0, 0]))) == "ok"


def ckpt(step, seen, per_rank=8, scaling="weak"):
    return {"step": step, "samples_seen": seen,
            "config": {"train": {"global_batch_size": per_rank, "scaling": scaling}}}


WEAK = {"train": {"global_batch_size": 8, "scaling": "weak"}}


def test_weak_scaling_resumed_on_another_world_size_is_refused_unless_forced():
    saved = ckpt(step=4, seen=64)  # dp 2: 16 samples per step
    with pytest.raises(ConfigError, match=r"the global batch: 16 -> 8 samples per step \(train.scaling=weak: "
                                          r"train.global_batch_size=8 per data-parallel rank, dp 2 -> 1\)"):
        check_saved(saved, WEAK, {}, False, "ckpt_4.pt", global_batch=8)
    (note,) = check_saved(saved, WEAK, {}, True, "ckpt_4.pt", global_batch=8)
    assert note == ("changed on resume (train.resume_force=true): the global batch: 16 -> 8 samples per "
                    "step (train.scaling=weak: train.global_batch_size=8 per data-parallel rank, dp 2 -> 1)")
    assert check_saved(saved, WEAK, {}, False, "ckpt_4.pt", global_batch=16) == []  # same dp: fine


def test_a_changed_global_batch_size_is_refused_once():
    current = {"train": {"global_batch_size": 4, "scaling": "weak"}}
    with pytest.raises(ConfigError) as e:
        check_saved(ckpt(step=4, seen=64), current, {}, False, "ckpt_4.pt", global_batch=8)
    assert "train.global_batch_size: 8 -> 4" in str(e.value) and "the global batch:" not in str(e.value)
