"""Scaling studies tracked in W&B, read back from W&B's own offline files (tests/wandb_offline.py):
each run's identity and steady-state summary, the slowest rank, a resume that logs no step
twice, weak scaling, and the study's report run with its table and native plots; what W&B got
agrees with metrics.jsonl, summary.json and report.md."""


import json
import re

import pytest

from tests.conftest import ROOT, SMALL, metrics
from tests.wandb_offline import runs_under, table


@pytest.mark.slow  # wandb starts its service process
def test_where_wandb_cannot_rewind_the_resume_is_a_new_run_linked_in_its_config(tmp_path, monkeypatch):
    import functools

    import wandb
    from omegaconf import OmegaConf

    from minddp.train.metrics.tracking import Tracker
    from minddp.train.metrics.wandb_run import mark_written, wandb_id

    real = wandb.init

    @functools.wraps(real)
    def server_without_rewind(*args, **kwargs):  # what a W&B server without rewind answers
        if kwargs.get("resume_from"):
            raise RuntimeError("rewinding runs is not enabled for this entity")
        return real(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", server_without_rewind)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                    for s in range(1, 6)))  # the first part, to step 5
    mark_written(tmp_path, 5)  # ... closed cleanly: W&B wrote its steps
    cfg = OmegaConf.create({"mode": "offline", "project": "p", "group": "g", "job_type": "train", "tags": []})
    tracker = Tracker(tmp_path, {"seed": 1}, cfg, "run", 8, start_step=3,
                      identity={"variant": "ddp", "scaling": "strong"})
    for step in range(4, 9):
        tracker.log({"step": step, "loss": 2.0})
    tracker.close()
    (w,) = runs_under(tmp_path)
    assert w["config"]["resumed_from"] == {"run_id": wandb_id(tmp_path), "step": 3}
    assert w["id"] != wandb_id(tmp_path) and w["group"] == "g" and w["branch"] is None
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


def test_an_unknown_scaling_mode_is_refused_naming_both(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from minddp.train.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as e:
            compose("config", overrides=[*SMALL, "train.scaling=linear"])
    assert "Invalid value 'linear', expected one of [strong, weak]" in str(e.value.__cause__)


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


def test_the_report_run_starts_offline_when_an_online_start_times_out(tmp_path, monkeypatch, capsys):
    """minddp report --wandb: a server that answers the probe but does not start the run within
    wandb_run.INIT_TIMEOUT_S gets one line and an offline run, never W&B's 90 s and no record."""
    import wandb

    from minddp.tools import wandb_report

    calls = []

    clock = iter([0.0, 30.0])  # the online attempt's start and its end, 30 s later

    def init(mode, **kwargs):
        calls.append((mode, kwargs["settings"].init_timeout))
        if mode == "online":
            raise wandb.errors.CommError("Run initialization has timed out after 30.0 sec.")
        return "offline run"

    monkeypatch.setattr(wandb_report.time, "monotonic", lambda: next(clock))

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb, "teardown", lambda: calls.append("teardown"))
    settings = wandb.Settings(quiet=True, init_timeout=wandb_report.INIT_TIMEOUT_S)
    assert wandb_report.start(tmp_path, {"settings": settings}, "online") == ("offline run", "offline")
    assert calls == [("online", 30.0), "teardown", ("offline", 30.0)]
    line = capsys.readouterr().out.strip()
    assert line.startswith("W&B: no online run within 30 s (CommError: Run initialization has timed out "
                           "after 30.0 sec.) (the report run); logging it offline") and "wandb sync" in line


def test_an_online_start_refused_at_once_says_what_happened(tmp_path, monkeypatch, capsys):
    """issue 56.12: a 404 in a second read "no online report run within 30 s"."""
    import wandb

    from minddp.tools import wandb_report

    def init(mode, **kwargs):
        if mode == "online":
            raise wandb.errors.CommError("404 Not Found: project not found\n(details)")
        return "offline run"

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb, "teardown", lambda: None)
    assert wandb_report.start(tmp_path, {}, "online") == ("offline run", "offline")
    line = capsys.readouterr().out.strip()
    assert re.match(r"W&B: the server refused the online run after \d+\.\d s \(CommError: 404 Not Found: "
                    r"project not found\) \(the report run\); logging it offline instead; upload later "
                    r"with wandb sync", line), line


@pytest.mark.parametrize("waited,says", [
    (29.5, "no online run within wandb.init_timeout=30 s (CommError: timed out)"),
    (0.3, "the server refused the online run after 0.3 s (CommError: timed out)"),
])
def test_the_training_runs_fallback_line_says_what_happened(waited, says):
    import wandb

    from minddp.train.metrics.wandb_run import no_online_run

    e = wandb.errors.CommError("timed out\nmore")
    assert no_online_run(e, waited, 30.0, "wandb.init_timeout=30 s") == says
