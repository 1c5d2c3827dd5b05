"""Issue 45.7 and 45.8: one reader of run folders (minddp.perf.runs.read_run) for `minddp report`
(and --wandb) and `minddp scaling --reuse`. A run whose files parse but have the wrong shape, an
empty or dangling metrics.jsonl, torn or blank lines, a --warmup that leaves no row: the run is
named with why in one line, and the others are reported."""

import json
import os

import pytest

from minddp.perf import study
from minddp.perf.runs import BadRun, read_run


def run(folder, world=1, rows=6, step_s=0.5, extra="", info=True):
    """A run folder as train.py leaves it (run.json, .hydra/overrides.yaml, metrics.jsonl)."""
    (folder / ".hydra").mkdir(parents=True)
    lines = [{"step": i + 1, "loss": 5.0 - 0.1 * i, "step_time_s": step_s, "tokens_per_s": 2000.0 / step_s,
              "comm/busy_s": 0.01, "comm/exposed_wait_s": 0.001, "comm/bytes": 4e6, "comm/collectives": 4}
             for i in range(rows)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + extra)
    if info:
        (folder / "run.json").write_text(json.dumps({"world_size": world, "config": {"seed": 1}}))
    (folder / ".hydra" / "overrides.yaml").write_text("- train.max_steps=6\n")
    return folder


BROKEN = {  # folder -> (how it is broken, what the line says)
    "ws-zero": (lambda d: (d / "run.json").write_text('{"world_size": 0, "config": {}}'),
                "run.json's world_size must be a whole number >= 1, got 0"),
    "ws-null": (lambda d: (d / "run.json").write_text('{"world_size": null}'),
                "run.json's world_size must be a whole number >= 1, got None"),
    "ws-str": (lambda d: (d / "run.json").write_text('{"world_size": "2"}'),
               "run.json's world_size must be a whole number >= 1, got '2'"),
    "info-folder": (lambda d: ((d / "run.json").unlink(), (d / "run.json").mkdir()),
                    "run.json cannot be read (Is a directory)"),
    "overrides-scalar": (lambda d: (d / ".hydra" / "overrides.yaml").write_text("train.max_steps=6\n"),
                         ".hydra/overrides.yaml holds a str, not a list"),
    "config-list": (lambda d: ((d / "run.json").unlink(), (d / ".hydra" / "config.yaml").write_text("- 1\n")),
                    ".hydra/config.yaml holds a list, not a mapping"),
    "empty": (lambda d: (d / "metrics.jsonl").write_text(""), "metrics.jsonl has no rows"),
    "dangling": (lambda d: ((d / "metrics.jsonl").unlink(), os.symlink(d / "gone", d / "metrics.jsonl")),
                 "metrics.jsonl cannot be read (No such file or directory)"),
}


def broken_study(folder):
    run(folder / "good-a", world=1, extra="\n{torn\n")
    run(folder / "good-b", world=2, step_s=0.4)
    for name, (damage, _) in BROKEN.items():
        damage(run(folder / name))


def test_report_names_each_broken_run_in_one_line_and_reports_the_others(tmp_path, capsys, drawn_figures):
    from minddp.tools import report

    broken_study(tmp_path)
    text = report.report(tmp_path)
    err = capsys.readouterr().err.splitlines()
    assert text.startswith("2 runs under"), text
    for name, (_, why) in BROKEN.items():
        said = [line for line in err if f"{tmp_path / name}:" in line]
        assert len(said) == 1 and why in said[0], (name, err)
        assert said[0].startswith("minddp report: warning: skipped")
    torn = [line for line in err if "good-a" in line]
    assert len(torn) == 1 and "skipped 1 malformed row(s) (line 8)" in torn[0]  # blank line 7: not a word
    assert len(err) == len(BROKEN) + 1


def test_read_run_raises_for_each_shape_and_reads_a_good_one(tmp_path):
    broken_study(tmp_path)
    assert read_run(tmp_path / "good-b")["world_size"] == 2
    for name, (_, why) in BROKEN.items():
        with pytest.raises(BadRun, match=why.replace("(", r"\(").replace(")", r"\)")):
            read_run(tmp_path / name)


def test_scaling_reuse_skips_what_it_cannot_read_and_keeps_the_others(tmp_path, capsys, drawn_figures,
                                                                        monkeypatch):
    """A torn and a blank line are skipped (a JSONDecodeError before), an empty file (a
    StatisticsError) and a --warmup past the rows are one line each."""
    from minddp.tools import scaling

    monkeypatch.setattr(scaling.os, "sched_getaffinity", lambda pid: {0, 1})
    runs = tmp_path / "study"
    run(runs / study.run_name("ddp", 1, 25, 0), extra="{torn\n\n")
    run(runs / study.run_name("ddp", 2, 25, 0), world=2, step_s=0.4)
    run(runs / study.run_name("ddp", 4, 25, 0), world=4).joinpath("metrics.jsonl").write_text("")
    run(runs / study.run_name("ddp", 1, 5, 0), rows=2)
    scaling.main(["--reuse", str(runs), "--worlds", "1,2,4", "--caps", "5,25", "--warmup", "2",
                  "--out", str(tmp_path / "s"), "--preset", "this-machine-gloo"])
    err = capsys.readouterr().err.splitlines()
    assert any("ws1-cap25/metrics.jsonl: skipped 1 malformed row(s) (line 7)" in line for line in err), err
    assert any(f"skipped {runs / 'ws4-cap25'}: metrics.jsonl has no rows" in line for line in err), err
    warmup = f"skipped {runs / 'ws1-cap5'}: --warmup 2 leaves none of its 2 rows"
    assert any(warmup in line for line in err), err
    table = [line for line in (tmp_path / "s.md").read_text().splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table[1:]] == ["1", "2"]  # worlds 1 and 2 at cap 25


def test_scaling_reuse_with_no_readable_run_is_one_line(tmp_path, capsys):
    from minddp.tools import scaling

    run(tmp_path / "study" / "ws1-cap25").joinpath("metrics.jsonl").write_text("\n")
    with pytest.raises(SystemExit) as e:
        scaling.main(["--reuse", str(tmp_path / "study"), "--worlds", "1", "--caps", "25",
                      "--out", str(tmp_path / "s"), "--preset", "this-machine-gloo"])
    assert "no run of the study under" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # wandb starts its service process
def test_report_wandb_logs_the_readable_runs(tmp_path, capsys, drawn_figures, monkeypatch):
    """--wandb reads the folders the same way: its report run's table holds the two good runs."""
    from minddp.tools import report
    from tests.wandb_offline import runs_under, table

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    broken_study(tmp_path / "study")
    report.report(tmp_path / "study", out=tmp_path / "out" / "report", to_wandb=True)
    (w,) = [w for w in runs_under(tmp_path) if w["job_type"] == "report"]
    assert len(table(w, "report/table")["data"]) == 2
