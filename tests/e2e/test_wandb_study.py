"""Scaling studies tracked in W&B, read back from W&B's own offline files (tests/wandb_offline.py):
each run's identity and steady-state summary, the slowest rank, a resume that logs no step
twice, weak scaling, and the study's report run with its table and native plots; what W&B got
agrees with metrics.jsonl, summary.json and report.md."""


import json
import shutil
import statistics
import subprocess

import pytest

from tests.conftest import SMALL, metrics
from tests.launch import run_train
from tests.wandb_offline import runs_under

IDENTITY = ("world_size", "dp", "tp", "nodes", "nproc_per_node", "backend", "device", "num_params",
            "accumulation", "tokens_per_step", "buckets", "variant", "repeat", "scaling", "torch_version",
            "minddp_version", "git_commit")


def _same(a, b):
    return a == pytest.approx(b, rel=1e-9) if isinstance(b, float) else a == b


@pytest.mark.slow
def test_a_weak_scaling_run_with_a_slow_rank_in_wandb_agrees_with_its_files(tmp_path):
    """2 ranks, weak scaling, rank 1 sleeps 1 s in step 4, replicas checked every 2 steps."""
    run = tmp_path / "run"
    run_train(run, *SMALL, "train.max_steps=8", "wandb.mode=offline", "wandb.group=study", "wandb.repeat=2",
              "train.scaling=weak", "train.check_every=2", "train.fault_sleep_step=4",
              "train.fault_sleep_rank=1", "train.fault_sleep_s=1.0", nproc=2)
    (w,) = runs_under(run)
    info, summary, rows = json.loads((run / "run.json").read_text()), \
        json.loads((run / "summary.json").read_text()), metrics(run)
    # identity: flat keys in W&B's config, the same in run.json; weak: 16 sequences per rank
    for key in IDENTITY:
        assert key in w["config"] and w["config"][key] == info[key], key
    assert (info["world_size"], info["nodes"], info["nproc_per_node"], info["scaling"]) == (2, 1, 2, "weak")
    assert (info["accumulation"], info["global_batch"], info["tokens_per_step"]) == (4, 32, 32 * 32)
    assert rows[-1]["samples_seen"] == 8 * 32  # the global batch grew with the world
    assert w["config"]["train"]["max_steps"] == 8  # the Hydra config beside it, as before
    assert w["name"] == info["name"] == "gpt-ws2-dp2-tp1-mb4-cap25-ddp-weak-r2"
    assert (w["group"], w["job_type"]) == ("study", "train") and {"ddp", "weak-scaling"} <= set(w["tags"])
    # history: every metrics row, once, at its step
    assert [h["_step"] for h in w["history"]] == [r["step"] for r in rows] == list(range(1, 9))
    for h, r in zip(w["history"], rows):
        assert h["loss"] == pytest.approx(r["loss"])
    # the slowest rank rides on the replica check: rank 1 in the window of step 4, rows 2, 4, 6, 8 only
    checked = {r["step"]: r for r in rows if "rank/slowest" in r}
    assert sorted(checked) == [2, 4, 6, 8]
    r4 = checked[4]
    assert r4["rank/slowest"] == 1 and r4["rank/step_time_max_s"] - r4["rank/step_time_min_s"] > 0.4, r4
    assert r4["rank/step_time_min_s"] <= r4["rank/step_time_median_s"] <= r4["rank/step_time_max_s"]
    # the summary: steady-state medians, the same in summary.json and W&B's summary
    steady = rows[len(rows) // 5:]  # after the warm-up: the first fifth of the rows
    assert summary["step_time_s"] == pytest.approx(statistics.median(r["step_time_s"] for r in steady))
    assert summary["val_loss"] == rows[-1]["val_loss"] and summary["best_val_loss"] <= summary["val_loss"]
    assert summary["steps"] == 8 and summary["rank/slowest"] in (0, 1)
    assert "mfu" not in summary and "mfu" not in w["summary"]  # no MFU on a CPU without train.peak_tflops
    for key in ("step_time_s", "tokens_per_s", "comm/busy_s", "comm/exposed_fraction", "machine/load_1min",
                "comm/busy_fraction", "val_loss", "best_val_loss", "rank/step_time_max_s"):
        assert _same(w["summary"][key], summary[key]), (key, w["summary"][key], summary[key])
    from minddp.tools import report  # minddp report reads the same numbers

    (r,) = [report.load_run(run)]
    assert r["summary"] == summary and r["scaling"] == "weak"


@pytest.mark.slow
def test_a_resumed_run_logs_no_step_twice_and_its_wandb_history_is_the_uninterrupted_one(tmp_path):
    """Stopped after step 5 (a clean stop: its summary is written), the step-5 checkpoint lost:
    the resume starts at 3 and rewinds the W&B run there (resume_from)."""
    args = [*SMALL, "train.max_steps=8", "train.ckpt_every=3", "wandb.mode=offline"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_train(ref, *args)
    run_train(run, *args, "train.stop_at_step=5")
    assert json.loads((run / "summary.json").read_text())["steps"] == 5  # written at the stop
    shutil.rmtree(run / "checkpoints" / "ckpt_00000005")  # as if it crashed after step 5
    run_train(run, *args, "train.resume=auto")
    first, second = runs_under(run)
    steps = lambda w: [h["_step"] for h in w["history"]]  # noqa: E731
    assert steps(first) == [1, 2, 3, 4, 5] and steps(second) == [4, 5, 6, 7, 8]
    assert second["id"] == first["id"] and second["branch"] == (first["id"], 3)  # rewound to the checkpoint
    seen = [h for h in first["history"] if h["_step"] <= 3] + second["history"]
    uninterrupted = metrics(ref)
    assert [h["_step"] for h in seen] == [r["step"] for r in uninterrupted]
    for h, r in zip(seen, uninterrupted):
        assert h["loss"] == pytest.approx(r["loss"], abs=1e-6), h["_step"]
    assert [r["step"] for r in metrics(run)] == list(range(1, 9))
    summary = json.loads((run / "summary.json").read_text())  # over both parts
    assert summary["steps"] == 8 and summary["steady_rows"] == 8 - 8 // 5
    assert _same(second["summary"]["val_loss"], summary["val_loss"])
    assert _same(second["summary"]["tokens_per_s"], summary["tokens_per_s"])


@pytest.mark.slow  # a shell
def test_the_upload_command_finds_every_offline_run_at_any_depth(tmp_path):
    from minddp.tools.wandb_report import upload_command

    runs = ["a/wandb/offline-run-1-x", "b/c/wandb/offline-run-2-y", "wandb/offline-run-3-z"]
    for d in [*runs, "d/wandb/run-4-online"]:
        (tmp_path / d).mkdir(parents=True)
    cmd = upload_command(tmp_path)
    assert cmd.startswith("wandb sync ")
    found = subprocess.run(["bash", "-c", cmd.replace("wandb sync", "echo", 1)], capture_output=True,
                           text=True).stdout.split()
    assert sorted(found) == sorted(str(tmp_path / d) for d in runs)
