"""Scaling studies tracked in W&B, read back from W&B's own offline files (tests/wandb_offline.py):
each run's identity and steady-state summary, the slowest rank, a resume that logs no step
twice, weak scaling, and the study's report run with its table and native plots; what W&B got
agrees with metrics.jsonl, summary.json and report.md."""

import json
import statistics
import subprocess

import pytest

from tests.conftest import ROOT, SMALL, metrics
from tests.launch import run_train
from tests.wandb_offline import runs_under, table

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
    for key in ("step_time_s", "tokens_per_s", "mfu", "comm/busy_s", "comm/exposed_fraction",
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
    (run / "checkpoints" / "ckpt_00000005.pt").unlink()  # as if it crashed after step 5
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


@pytest.mark.slow  # wandb starts its service process
def test_where_wandb_cannot_rewind_the_resume_is_a_new_run_linked_in_its_config(tmp_path, monkeypatch):
    import functools

    import wandb
    from omegaconf import OmegaConf

    from minddp.train.metrics.tracking import Tracker, _wandb_id

    real = wandb.init

    @functools.wraps(real)
    def server_without_rewind(*args, **kwargs):  # what a W&B server without rewind answers
        if kwargs.get("resume_from"):
            raise RuntimeError("rewinding runs is not enabled for this entity")
        return real(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", server_without_rewind)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                    for s in range(1, 6)))  # the first part, to step 5
    cfg = OmegaConf.create({"mode": "offline", "project": "p", "group": "g", "job_type": "train", "tags": []})
    tracker = Tracker(tmp_path, {"seed": 1}, cfg, "run", 8, start_step=3,
                      identity={"variant": "ddp", "scaling": "strong"})
    for step in range(4, 9):
        tracker.log({"step": step, "loss": 2.0})
    tracker.close()
    (w,) = runs_under(tmp_path)
    assert w["config"]["resumed_from"] == {"run_id": _wandb_id(tmp_path), "step": 3}
    assert w["id"] != _wandb_id(tmp_path) and w["group"] == "g" and w["branch"] is None
    assert [h["_step"] for h in w["history"]] == [4, 5, 6, 7, 8]  # the new run: each step once
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 9))


def _study_run(run_dir, world, cap, step_s, busy_s, scaling="strong", variant="ddp"):
    """A run as train.py leaves it: run.json (identity + config) and metrics.jsonl."""
    run_dir.mkdir(parents=True)
    tokens = 512 * (world if scaling == "weak" else 1)
    rows = [{"step": i + 1, "loss": 5.0 - 0.1 * i, "step_time_s": step_s, "tokens_per_s": tokens / step_s,
             "comm/busy_s": busy_s, "comm/exposed_wait_s": busy_s / 4,
             "comm/exposed_fraction": busy_s / 4 / step_s,
             "comm/collectives": 2, "comm/bytes": 4e5,
             **({"rank/step_time_min_s": step_s / 2, "rank/step_time_median_s": step_s * 0.6,
                 "rank/step_time_max_s": step_s * 0.9, "rank/slowest": world - 1} if i % 2 else {})}
            for i in range(10)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"ddp": {"bucket_cap_mb": cap}, "train": {"scaling": scaling}, "seed": 1,
              "wandb": {"group": "sweep-7", "project": "minddp"}}
    (run_dir / "run.json").write_text(json.dumps({"world_size": world, "scaling": scaling, "variant": variant,
                                                  "accumulation": 1, "config": config}))


@pytest.mark.slow  # wandb starts its service process
def test_the_report_run_holds_the_table_the_native_plots_and_the_figure(tmp_path, capsys, monkeypatch):
    from minddp.tools import report

    monkeypatch.setenv("WANDB_MODE", "offline")
    study = tmp_path / "sweep-7"
    for world, step in ((1, 0.4), (2, 0.25), (4, 0.2)):
        for cap in (1, 25):
            slower = 1.1 if cap == 1 else 1.0
            _study_run(study / f"ws{world}-cap{cap}", world, cap, step * slower, 0.01 * world)
    report.main([str(study), "--wandb"])
    out = capsys.readouterr().out
    assert out.count("wandb sync") == 1 and f"wandb sync $(find {study} -type d -name 'offline-run-*')" in out
    (w,) = runs_under(study)
    assert (w["job_type"], w["group"], w["name"]) == ("report", "sweep-7", "report-sweep-7")
    # the table is report.md's
    md = [line for line in (study / "report.md").read_text().splitlines() if line.startswith("|")]
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    logged = table(w, "report/table")
    assert logged["columns"] == cells(md[0]) and [[str(c) for c in r] for r in logged["data"]] == \
        [cells(line) for line in md[2:]]
    assert "strong scaling (fixed global batch): T1 / (n Tn)" in (study / "report.md").read_text()
    # native line plots, one line per bucket cap (+ the ideal), against the world size
    for key in ("tokens_per_s", "efficiency", "comm", "predicted_busy", "rank_spread"):
        assert w["charts"][f"report/{key}"]["panel_config"]["panelDefId"] == "wandb/lineseries/v0", key
    lines = {}
    for x, name, y in table(w, "report/tokens_per_s_table")["data"]:
        lines.setdefault(name, {})[x] = y
    cap25 = "ddp.bucket_cap_mb=25"
    assert lines[cap25] == pytest.approx({1: 512 / 0.4, 2: 512 / 0.25, 4: 512 / 0.2})
    assert lines[f"ideal, {cap25}"] == pytest.approx({1: 512 / 0.4, 2: 2 * 512 / 0.4, 4: 4 * 512 / 0.4})
    eff = {x: y for x, name, y in table(w, "report/efficiency_table")["data"] if name == cap25}
    assert eff == pytest.approx({1: 1.0, 2: 0.4 / (2 * 0.25), 4: 0.4 / (4 * 0.2)})
    spread = {name.split(",")[0]: y for x, name, y in table(w, "report/rank_spread_table")["data"] if x == 4
              and name.endswith(cap25)}
    assert spread == pytest.approx({"min": 0.1, "median": 0.12, "max": 0.18})
    predicted = [y for x, name, y in table(w, "report/predicted_busy_table")["data"]
                 if name == f"cost model, {cap25}" and x == 2]
    assert predicted and predicted[0] > 0  # the calibrated cost model's busy time at world 2
    assert (w["file"].parent / "files" / w["summary"]["report/figure/path"]).exists()  # the PNG


def test_weak_efficiency_is_t1_over_tn_and_the_report_says_which(tmp_path):
    from minddp.tools import report

    for world, step in ((1, 0.4), (2, 0.5)):
        _study_run(tmp_path / f"w{world}", world, 25, step, 0.0, scaling="weak")
    text = report.report(tmp_path)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and "world_size" not in line}
    assert "weak scaling (fixed batch per rank): T1 / Tn" in text and "T1 / (n Tn)" not in text
    assert rows["2"][4] == "0.80" and rows["2"][9] == "weak"  # 0.4 / 0.5, not 0.4 / (2 x 0.5)


@pytest.mark.parametrize("scaling,world,accum,global_batch", [("strong", 2, 2, 16), ("weak", 2, 4, 32),
                                                             ("weak", 4, 4, 64), ("strong", 4, 1, 16)])
def test_weak_scaling_fixes_each_ranks_batch_and_strong_the_global_one(scaling, world, accum, global_batch):
    from hydra import compose, initialize_config_dir

    from minddp.train.config import register, validate

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*SMALL, f"train.scaling={scaling}"])
    derived = validate(cfg, world)
    assert (derived["accum"], derived["global_batch"]) == (accum, global_batch)


def test_an_unknown_scaling_mode_is_one_line_naming_both(tmp_path):
    from hydra import compose, initialize_config_dir

    from minddp.errors import ConfigError
    from minddp.train.config import register, validate

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*SMALL, "train.scaling=linear"])
    with pytest.raises(ConfigError, match="train.scaling must be strong or weak, got 'linear'"):
        validate(cfg, 2)


def test_the_summary_is_the_steady_state_of_every_row():
    from minddp.train.metrics.summary import summary

    rows = [{"step": s, "loss": 6.0 - s, "step_time_s": 9.0 if s <= 2 else 1.0 + s / 100,
             "tokens_per_s": 100.0,
             "comm/busy_s": 0.5, **({"val_loss": v} if (v := {5: 3.0, 10: 3.5}.get(s)) else {})}
            for s in range(1, 11)]
    s = summary(rows)
    assert s["warmup_rows"] == 2 and s["steady_rows"] == 8  # the first fifth is warm-up
    assert s["step_time_s"] == pytest.approx((1.06 + 1.07) / 2)  # median after it
    assert (s["val_loss"], s["best_val_loss"], s["loss"], s["steps"]) == (3.5, 3.0, -4.0, 10)
    assert s["comm/busy_fraction"] == pytest.approx(0.5 / ((1.06 + 1.07) / 2), rel=1e-2)
    assert "mfu" not in s and summary([]) == {}


def test_identity_names_differ_by_variant_and_repeat():
    from omegaconf import OmegaConf

    from minddp.train.metrics import identity

    cfg = OmegaConf.create({"model": {"name": "gpt", "block_size": 32}, "train": {"micro_batch_size": 4},
                            "ddp": {"bucket_cap_mb": None}, "wandb": {"name": None}})
    names = {identity.run_name(cfg, {"world_size": 2, "dp": 2, "tp": 1, "variant": v, "repeat": k,
                                     "scaling": "strong"}) for v in ("ddp", "zero1") for k in (0, 1)}
    assert len(names) == 4 and "gpt-ws2-dp2-tp1-mb4-cap25-zero1-r1" in names


def test_the_git_commit_is_read_from_the_checkout_without_git(tmp_path):
    from minddp.train.metrics.identity import git_commit

    assert git_commit(tmp_path) is None  # not a checkout
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("a" * 40 + "\n")
    assert git_commit(tmp_path) == "a" * 40
    (git / "refs" / "heads" / "main").unlink()  # after git gc: packed-refs
    (git / "packed-refs").write_text(f"# pack-refs\n{'b' * 40} refs/heads/main\n")
    assert git_commit(tmp_path) == "b" * 40
    (git / "HEAD").write_text("c" * 40 + "\n")  # detached
    assert git_commit(tmp_path) == "c" * 40


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
