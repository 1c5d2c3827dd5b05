"""The collective benchmark checks every result, and the scaling study runs end to end."""


import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import pytest

from minddp.tools import render
from tests import launch
from tests.conftest import BIN, ROOT, SMALL, metrics
from tests.files import line_data, md_rows
from tests.launch import run_train


def plt_image(path):
    import matplotlib.image

    return matplotlib.image.imread(path)


@pytest.mark.slow
def test_cli_under_torchrun_writes_json(tmp_path):
    p = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "minddp", "bench",
                        "-b", "1K", "-e", "64K", "-f", "8", "--op", "all_reduce,all_to_all",
                        "--json", str(tmp_path / "out.json")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "alpha-beta fit (all_reduce)" in p.stdout and "memory copy bandwidth" in p.stdout
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["world_size"] == 2 and {r["op"] for r in data["rows"]} == {"all_reduce", "all_to_all"}


@pytest.mark.slow
def test_scaling_study_smoke(tmp_path):
    out = tmp_path / "scaling"
    p = launch.script(["-m", "minddp", "scaling", "--worlds", "1,2", "--caps", "25", "--steps", "4",
                    "--warmup", "1", "--out", str(out), "data=synthetic", "model.n_layer=1",
                    "wandb.mode=disabled"], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = Path(p.stdout.rsplit("runs in ", 1)[1].strip())
    assert runs.parent == tmp_path and runs.name.startswith("scaling-")  # beside --out, not the package's
    assert not list(runs.rglob("ckpt_*")), "a timing run saved a checkpoint (issue 56.8)"
    rows = {r["world"]: r for r in md_rows((tmp_path / "scaling.md").read_text())}
    assert rows.keys() == {"1", "2"}
    for world, row in rows.items():  # the table is the runs' own medians after the warm-up
        steps = [m["step_time_s"] for m in metrics(runs / f"ws{world}-cap25")][1:]
        assert float(row["step (ms)"]) == pytest.approx(statistics.median(steps) * 1e3, abs=0.06)
    step1, step2 = (float(rows[w]["step (ms)"]) for w in ("1", "2"))
    if rows["2"]["efficiency"] != "oversubscribed":
        assert float(rows["2"]["efficiency"]) == pytest.approx(step1 / (2 * step2), abs=0.01)
    measured, predicted = float(rows["2"]["busy measured (ms)"]), float(rows["2"]["busy predicted (ms)"])
    assert measured > 0
    assert float(rows["2"]["predicted / measured"]) == pytest.approx(predicted / measured, abs=0.02)
    # the figure's content is checked in test_scaling_table_and_figure_hold_the_runs_numbers
    assert plt_image(tmp_path / "scaling.png").shape[:2] == (440, 1210)  # 11 x 4 in at 110 dpi


@pytest.mark.slow
def test_report_collects_runs_of_different_world_sizes_and_caps(tmp_path, drawn_figures):
    sweep = tmp_path / "sweep"
    for nproc, cap in ((1, 0.01), (2, 0.01), (2, 25)):
        run_train(sweep / f"ws{nproc}-cap{cap}", *SMALL, "train.max_steps=3", f"ddp.bucket_cap_mb={cap}",
                  nproc=nproc)
    p = launch.script(["-m", "minddp", "report", str(sweep)], timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    text = (sweep / "report.md").read_text()
    assert "swept: world_size, ddp.bucket_cap_mb" in text
    lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [line.split(" | ") for line in lines][1:]
    assert len(rows) == 3
    by = {(r[0].strip("| "), r[1]): r for r in rows}
    assert by[("1", "0.01")][5] == "1.00"  # the smallest world is the efficiency baseline
    assert by[("2", "25.0")][5] == "1.00"  # no world-1 peer at 25
    ratio = float(by[("2", "0.01")][4]) / float(by[("1", "0.01")][4]) / 2  # tokens/s vs world 1, per rank
    assert float(by[("2", "0.01")][5]) == pytest.approx(ratio, abs=0.01)
    for (world, cap), r in by.items():  # the final loss is the run's own last logged loss
        last = metrics(sweep / f"ws{world}-cap{float(cap):g}")[-1]
        assert r[7] == f"{last['loss']:.4f}" and r[9].strip(" |") == "-", (r, last)  # no MFU on a CPU
    assert plt_image(sweep / "report.png").shape[:2] == (484, 1210)  # 11 x 4.4 in at 110 dpi
    from minddp.tools import report  # again in-process, to read its figure: the table's tokens/s per cap

    report.report(sweep, tmp_path / "again")
    drawn = {tuple(x): y for x, y in line_data(drawn_figures[0].axes[0])}
    tokens = lambda world, cap: float(by[(world, cap)][4])  # noqa: E731
    assert drawn.keys() == {(1, 2), (2,)}
    assert drawn[(1, 2)] == pytest.approx([tokens("1", "0.01"), tokens("2", "0.01")], abs=0.5)
    assert drawn[(2,)] == pytest.approx([tokens("2", "25.0")], abs=0.5)


@pytest.mark.slow
def test_engine_and_trainer_benchmarks_write_their_tables(tmp_path):
    """Smoke runs of `make bench` and `make bench-trainer` at the smallest sizes."""
    out = tmp_path / "bench_ddp.md"
    # 3 rounds: torch DDP logs its rebuilt bucket sizes only after a few iterations
    argv = ["-m", "minddp", "bench-ddp", "--repeats", "1", "--rounds", "3", "--steps-per-round", "1",
            "--n-layer", "1", "--n-embd", "96", "--caps", "0.05", "--out", str(out)]
    p = launch.script(argv, 2, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 0.05 |"))
    ours, theirs = row.split(" | ")[1].split(" / ")
    assert ours == theirs  # the same bucket count as torch DDP at the same cap
    assert "minddp shard_optimizer (ZeRO-1)" in text and "cost per bucket" in text
    assert "| minddp DDP(compile(model)) |" in text and "| torch DDP(compile(model)) |" in text
    doc = json.loads(out.with_suffix(".json").read_text())  # the measurements, and the md rendered from them
    assert text == render.markdown(doc["blocks"]) + "\n" and doc["data"]["ratios"]["0.05"][0] > 0
    out = tmp_path / "bench_trainer.md"
    env = {**os.environ, "MINDDP_CACHE": str(tmp_path / "cache")}
    trainer_dirs = lambda: set(Path(tempfile.gettempdir()).glob("bench-trainer-*"))  # noqa: E731
    before = trainer_dirs()  # (the ranks are forked: they share this process's temporary folder)
    p = launch.script(["-m", "minddp", "bench-trainer", "--repeats", "1", "--rounds", "1", "--steps", "1",
                    "--out", str(out)], 2, env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert trainer_dirs() <= before  # each rank's trainer run dir, removed
    text = out.read_text()
    assert "| bare loop |" in text and "| nanoGPT-style loop |" in text
    assert "`agree`" in text and "`opt.step`" in text
    doc = json.loads(out.with_suffix(".json").read_text())
    assert text == render.markdown(doc["blocks"]) + "\n" and set(doc["data"]["ratios"]) == {
        "trainer", "bare loop", "nanoGPT-style loop"}


def test_the_whole_run_checkpoint_bench_writes_its_table(tmp_path):
    """make bench-checkpoint's whole-run half (scripts/bench_checkpoint_runs.py), one round on a
    small model: every variant measured against `none` in the same round."""
    import sys

    out, raw = tmp_path / "runs.md", tmp_path / "runs.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_checkpoint_runs.py"), "--rounds", "1",
                        "--nproc", "1", "--variants", "defaults,file", "--out", str(out), "--json", str(raw),
                        "--overrides", *SMALL, "train.max_steps=4"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(raw.read_text())
    assert list(results) == ["none", "defaults", "file"]
    for runs in results.values():
        (run,) = runs
        assert run["wall"] > run["loop"] > 0 and run["peak_rss_mb"] > 0 and run["disk_mb"] > 0, run
    assert results["file"][0]["disk_mb"] > results["defaults"][0]["disk_mb"]  # four files kept, three folders
    rows = [line.split(" | ")[0] for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| none", "| defaults", "| file"], out.read_text()
