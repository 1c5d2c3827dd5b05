"""make scaling's repeats and variants: rotated order, medians and spreads, ZeRO-1 predicted as
a reduce-scatter per bucket, beside DDP at world 2."""


import json
from pathlib import Path

import pytest

from minddp.perf import costmodel as cm
from minddp.perf import study
from minddp.tools import scaling


def test_every_repeat_runs_every_configuration_in_a_rotated_order():
    rounds = study.plan(["ddp", "zero1"], [1, 2], [1, 25], repeats=3)
    jobs = {("ddp", 1, 1), ("ddp", 2, 1), ("zero1", 2, 1), ("ddp", 1, 25), ("ddp", 2, 25), ("zero1", 2, 25)}
    assert all(sorted(r) == sorted(jobs) for r in rounds)  # ZeRO-1 only at world 2
    assert len({r[0] for r in rounds}) == 3  # each repeat starts elsewhere


def test_run_names_keep_the_first_ddp_run_where_earlier_studies_put_it():
    assert study.run_name("ddp", 2, 25.0, 0) == "ws2-cap25"
    assert study.run_name("zero1", 2, 1.0, 2) == "zero1-ws2-cap1-r2"


def test_repeats_give_medians_and_spreads():
    runs = [{"step_s": s, "tokens_per_s": 1 / s, "busy_s": b, "exposed_s": 0.0, "bytes": 8, "collectives": 2}
            for s, b in ((0.5, 0.05), (0.7, 0.02), (0.6, 0.09))]
    c = study.combine(runs)
    assert (c["step_s"], c["busy_s"], c["repeats"]) == (0.6, 0.05, 3)
    assert c["step_spread"] == (0.5, 0.7) and c["busy_spread"] == (0.02, 0.09)


def _fake(run_dir, busy_s, collectives=4, nbytes=40e6):
    run_dir.mkdir(parents=True)
    rows = [{"step": i + 1, "step_time_s": 0.5, "tokens_per_s": 2000.0, "comm/busy_s": busy_s,
             "comm/exposed_wait_s": 0.01, "comm/bytes": nbytes, "comm/collectives": collectives}
            for i in range(6)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_zero1_rows_are_predicted_as_reduce_scatters(tmp_path, monkeypatch, drawn_figures):
    monkeypatch.setattr(study.os, "sched_getaffinity", lambda pid: {0, 1})
    runs = tmp_path / "runs"
    for k, busy in enumerate((0.05, 0.07, 0.06)):
        _fake(runs / study.run_name("ddp", 2, 25, k), busy)
        _fake(runs / study.run_name("zero1", 2, 25, k), busy / 2)
    cal = {"alpha": 400e-6, "beta": 1e9, "contention": {"factor": 2.0}, "overhead_per_bucket_s": 1e-4,
           "floor": {"per_bucket_s": 3e-3},  # the all-reduce simulated, the reduce-scatter per bucket
           "under_backward": {"all_reduce": {"slowdown": 3.0, "backward_share": 0.7}}}
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    scaling.main(["--reuse", str(runs), "--worlds", "2", "--caps", "25", "--repeats", "3", "--warmup", "1",
                  "--variants", "ddp,zero1", "--out", str(tmp_path / "s"),
                  "--calibration", str(tmp_path / "cal.json")])
    lines = [x for x in (tmp_path / "s.md").read_text().splitlines() if x.startswith("| 2 | 25 |")]
    rows = {c[2]: c for c in ([x.strip() for x in line.strip("|").split("|")] for line in lines)}
    assert rows["ddp"][8:10] == ["60.0", "50.0-70.0"] and rows["zero1"][8:10] == ["30.0", "25.0-35.0"]
    c = cm.Calibration.load(tmp_path / "cal.json")
    backward = 0.49 / 2 * 0.7  # the synchronised micro-step's (2 per step at world 2), its share
    ring = cm.predict_ddp_comm([10e6] * 4, 2, c, backward)["busy_s"]
    rs = cm.predict_ddp_comm([10e6] * 4, 2, c, backward, op="reduce_scatter")["busy_s"]
    assert float(rows["ddp"][10]) == pytest.approx(ring * 1e3, abs=0.05)
    assert float(rows["zero1"][10]) == pytest.approx(rs * 1e3, abs=0.05)
    # the collectives alone: 4 buckets, each its ring time and the engine's cost, nothing beside
    alone = 4 * (cm.ring_all_reduce_time(10e6, 2, 400e-6, 1e9) + 1e-4)
    assert float(rows["ddp"][12]) == pytest.approx(alone / 0.06, abs=0.01)
    assert ring > alone * 1.2 and rs > alone / 2  # what backward's company costs


def test_weak_mode_runs_with_train_scaling_weak_a_repeat_each_and_reads_t1_over_tn(tmp_path, monkeypatch):
    """--mode weak: every run gets train.scaling=weak and its repeat (a W&B name of its own);
    efficiency T1 / Tn, the batch per rank fixed (accumulation 4 at every world)."""
    import argparse

    launched = []
    monkeypatch.setattr(study, "run", lambda run_dir, w, c, steps, group, extra: launched.append(
        (run_dir.name, extra)) or _fake(run_dir, 0.05))
    monkeypatch.setattr(study.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    args = argparse.Namespace(repeats=2, reuse=None, steps=4, warmup=1, mode="weak", overrides=[])
    runs = study.collect(args, ["ddp"], [1, 2], [25.0], tmp_path, "g")
    assert sorted(name for name, _ in launched) == ["ws1-cap25", "ws1-cap25-r1", "ws2-cap25", "ws2-cap25-r1"]
    for name, extra in launched:
        assert "train.scaling=weak" in extra and f"wandb.repeat={1 if name.endswith('-r1') else 0}" in extra
    assert [study.accumulation(w, "weak") for w in (1, 2, 4)] == [4, 4, 4]
    assert [study.accumulation(w) for w in (1, 2, 4)] == [4, 2, 1]
    runs[("ddp", 2, 25.0)] = [{**r, "step_s": 0.625} for r in runs[("ddp", 2, 25.0)]]
    cal = cm.Calibration(cm.PRESETS["this-machine-gloo"])
    eff = {r["world"]: r["efficiency"] for r in study.analyse(runs, cal, "weak")}
    assert eff == {1: 1.0, 2: pytest.approx(0.5 / 0.625)}  # T1 / Tn, not T1 / (2 Tn)
    strong = {r["world"]: r["efficiency"] for r in study.analyse(runs, cal)}
    assert strong[2] == pytest.approx(0.5 / (2 * 0.625))


def _study_in_process(tmp_path, monkeypatch, *argv) -> tuple[list, list]:
    """`minddp scaling ARGV` with each run faked (no process) and the W&B report run recorded:
    (the run folders it chose, the folders it reported). A run folder outside tmp_path fails
    before anything is written there."""
    runs, reported = [], []

    def run(run_dir, world, cap, steps, group, extra):
        assert run_dir.is_absolute() and tmp_path in run_dir.parents, f"a run outside the study: {run_dir}"
        runs.append(run_dir)
        _fake(run_dir, 0.05)

    monkeypatch.setattr(study, "run", run)
    monkeypatch.setattr("minddp.tools.report.report", lambda folder, to_wandb: reported.append(Path(folder)))
    monkeypatch.setattr(study.os, "sched_getaffinity", lambda pid: {0, 1})
    scaling.main(["--worlds", "1,2", "--caps", "25", "--steps", "6", "--warmup", "1",
                  "--preset", "this-machine-gloo", *argv])
    return runs, reported


def test_a_study_writes_its_runs_and_report_beside_out(tmp_path, monkeypatch, drawn_figures):
    """--out PREFIX: the runs in PREFIX's folder (scaling-<time>/), the report at PREFIX; the
    package's own outputs/ gains nothing, wherever the command runs."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    runs, reported = _study_in_process(tmp_path, monkeypatch, "--out", str(tmp_path / "mine" / "study"))
    folder = runs[0].parent
    assert folder.parent == tmp_path / "mine" and folder.name.startswith("scaling-")
    assert sorted(r.name for r in runs) == ["ws1-cap25", "ws2-cap25"] and reported == [folder]
    assert (tmp_path / "mine" / "study.md").exists() and (tmp_path / "mine" / "study.png").exists()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == [folder.name, "study.json", "study.md",
                                                                     "study.png"]
    assert not any((tmp_path / "cwd").iterdir())


def test_a_study_without_out_writes_under_outputs_where_it_runs(tmp_path, monkeypatch, drawn_figures):
    monkeypatch.chdir(tmp_path)
    runs, reported = _study_in_process(tmp_path, monkeypatch)
    folder = runs[0].parent
    assert folder.parent == tmp_path / "outputs" and reported == [folder]
    assert (folder / "scaling.md").exists() and (folder / "scaling.png").exists()
