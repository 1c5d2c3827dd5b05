"""The collective benchmark checks every result, and the scaling study runs end to end."""

import json
import os
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from minddp.perf.costmodel import busbw_factor
from minddp.perf.sweep import OPS, fit_alpha_beta, run_op
from minddp.tools import render
from tests import launch
from tests.conftest import BIN, ROOT, SMALL, metrics
from tests.launch import run_train


def plt_image(path):
    import matplotlib.image

    return matplotlib.image.imread(path)


def _all_ops(rank, world_size):
    out = {}
    for op in OPS:
        rows = run_op(op, [8, 1000, 70_000], torch.float32, warmup=1, iters=2)
        for r in rows:
            assert r["wrong"] == 0, r
            assert r["busbw"] == pytest.approx(r["algbw"] * busbw_factor(op, world_size))
        out[op] = rows
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_is_checked_and_correct(world_size):
    rows = launch.ranks(_all_ops, world_size, timeout=120)[0]
    for op, rs in rows.items():
        assert [r["size"] for r in rs] == sorted({r["size"] for r in rs}), (op, rs)  # three sizes, rising
        for r in rs:  # the columns are nccl-tests': algbw = size / time, in GB/s
            assert r["size"] == r["count"] * 4 and r["count"] % world_size == 0
            assert r["algbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)


# (op, n) -> the cost coefficients (ca, cb) of t = ca * alpha + cb * size / beta, written out
KNOWN = {("all_reduce", 4): (6, 1.5), ("all_gather", 3): (2, 2 / 3), ("tree_all_reduce", 8): (6, 6),
         ("broadcast", 4): (2, 1.0)}


@pytest.mark.parametrize("op,n", sorted(KNOWN))
def test_alpha_beta_fit_recovers_a_known_machine(op, n):
    alpha, beta = 30e-6, 2.5e9  # 30 us, 2.5 GB/s
    ca, cb = KNOWN[(op, n)]
    rows = [{"op": op, "size": size, "time_us": (ca * alpha + cb * size / beta) * 1e6}
            for size in (8, 4096, 1 << 20, 64 << 20)]
    got_alpha, got_beta = fit_alpha_beta(rows, n)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)
    noisy = [{**r, "time_us": r["time_us"] * (1.03 if i % 2 else 0.97)} for i, r in enumerate(rows)]
    # unweighted least squares: the large messages set beta, so 3% noise moves it by about 3%
    assert fit_alpha_beta(noisy, n)[1] == pytest.approx(beta, rel=0.05)


def _wrong_counts(rank, world_size):
    """The sweep's check of an all-reduce case, run over a collective that does nothing and over
    the real one (no torch function patched: the case takes its collective)."""
    from minddp.perf import sweep

    c = sweep._Inputs(64, torch.float32, world_size, rank, torch.device("cpu"))
    _, broken = sweep._sum_of_ranks(c, lambda: None)
    _, real = sweep._sum_of_ranks(c, lambda: torch.distributed.all_reduce(c.x))
    return broken(), real()


def test_wrong_results_are_counted():
    for broken, real in launch.ranks(_wrong_counts, 2):
        assert broken == 16 and real == 0  # every one of the 16 elements is wrong, then none


def md_rows(text: str) -> list[dict]:
    """A markdown table's rows as {header: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    return [dict(zip(cells(lines[0]), cells(line))) for line in lines[2:]]


def fake_run(run_dir, world, cap, step_s, tokens_per_s, busy_s, rows=10):
    """A run as train.py leaves it: run.json and metrics.jsonl (two slow warm-up steps first)."""
    run_dir.mkdir(parents=True)
    slow = lambda i: 10.0 if i < 2 else 1.0  # noqa: E731
    lines = [{"step": i + 1, "loss": 5.5 - 0.25 * i, "step_time_s": step_s * slow(i),
              "tokens_per_s": tokens_per_s / slow(i), "comm/busy_s": busy_s, "comm/exposed_wait_s": 0.002,
              "comm/exposed_fraction": 0.002 / step_s, "comm/bytes": 4_000_000 * world,
              "comm/collectives": 2, "mfu": 0.01} for i in range(rows)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    config = {"ddp": {"bucket_cap_mb": cap}, "seed": 0}
    (run_dir / "run.json").write_text(json.dumps({"world_size": world, "config": config}))
    return lines


def line_data(ax):
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]


def test_report_table_and_figure_hold_the_runs_numbers(tmp_path, drawn_figures):
    from minddp.tools import report

    last = {(1, 1): fake_run(tmp_path / "a", 1, 1, 0.8, 1000, 0.0)[-1],
            (2, 1): fake_run(tmp_path / "b", 2, 1, 0.5, 1600, 0.05)[-1],
            (2, 25): fake_run(tmp_path / "c", 2, 25, 0.4, 2000, 0.03)[-1]}
    rows = {(int(r["world_size"]), float(r["ddp.bucket_cap_mb"])): r
            for r in md_rows(report.report(tmp_path))}
    assert rows.keys() == last.keys()
    # medians after the warm-up; efficiency against the smallest world at the same cap
    assert [rows[k]["step (ms)"] for k in last] == ["800.0", "500.0", "400.0"]
    assert [rows[k]["tokens/s"] for k in last] == ["1000", "1600", "2000"]
    assert [rows[k]["efficiency"] for k in last] == ["1.00", "0.80", "1.00"]  # no world-1 run at 25
    for k, row in last.items():
        assert rows[k]["loss"] == f"{row['loss']:.4f}" and rows[k]["steps"] == "10"
    (fig,) = drawn_figures  # the figure draws the table's throughput, one line per cap
    lines = sorted(line_data(fig.axes[0]))
    assert lines == [([1, 2], [1000, 1600]), ([2], [2000])], lines


@pytest.mark.slow  # matplotlib, seconds
def test_scaling_table_and_figure_hold_the_runs_numbers(tmp_path, drawn_figures, monkeypatch):
    from minddp.tools import scaling

    monkeypatch.setattr(scaling.os, "sched_getaffinity", lambda pid: {0, 1})  # 2 cores: world 2 fits
    fake_run(tmp_path / "runs" / "ws1-cap25", 1, 25, 0.8, 1000, 0.004)
    fake_run(tmp_path / "runs" / "ws2-cap25", 2, 25, 0.5, 1600, 0.05)
    scaling.main(["--reuse", str(tmp_path / "runs"), "--worlds", "1,2", "--caps", "25", "--warmup", "2",
                  "--out", str(tmp_path / "scaling"), "--calibration", str(tmp_path / "none.json")])
    one, two = md_rows((tmp_path / "scaling.md").read_text())
    assert (one["world"], two["world"]) == ("1", "2")
    assert (one["step (ms)"], two["step (ms)"]) == ("800.0", "500.0")
    assert (one["efficiency"], two["efficiency"]) == ("1.00", "0.80")  # T1 / (2 T2)
    assert (one["busy measured (ms)"], two["busy measured (ms)"]) == ("4.0", "50.0")
    ratio = float(two["busy predicted (ms)"]) / 50.0
    assert float(two["predicted / measured"]) == pytest.approx(ratio, abs=0.01)
    (fig,) = drawn_figures
    throughput, busy = fig.axes[:2]
    assert line_data(throughput) == [([1, 2], [1000, 1600])]
    (mx, my), (px, py) = line_data(busy)  # measured, then the calibrated model's prediction
    assert mx == px == [1, 2] and my == pytest.approx([4.0, 50.0])
    predicted = [float(one["busy predicted (ms)"]), float(two["busy predicted (ms)"])]
    assert py == pytest.approx(predicted, abs=0.05)


def test_timeline_figure_draws_every_span_of_the_trace(tmp_path, drawn_figures):
    from matplotlib.colors import to_hex

    from minddp.train.metrics.steptrace import chrome_trace, render

    rank0 = {"compute": [("forward 0", 0.0, 0.010), ("backward 0", 0.010, 0.030),
                         ("exposed wait", 0.030, 0.032)],
             "comm": [("bucket 0", 0.015, 0.021), ("bucket 1", 0.026, 0.031)]}
    rank1 = {"compute": [("forward 0", 0.001, 0.012), ("backward 0", 0.012, 0.033)],
             "comm": [("bucket 0", 0.016, 0.024)]}
    render({"overlap on": [rank0, rank1]}, str(tmp_path / "t.png"))
    (fig,) = drawn_figures
    bars = sorted((round(p.get_y() + p.get_height() / 2), round(p.get_x(), 6), round(p.get_width(), 6),
                   to_hex(p.get_facecolor())) for p in fig.axes[0].patches)
    # lanes: rank r's comm at y = 3r, its compute at 3r + 1; spans in ms since the step started
    want = [(0, 15.0, 6.0, "#e6a157"), (0, 26.0, 5.0, "#dd8452"), (1, 0.0, 10.0, "#4c72b0"),
            (1, 10.0, 20.0, "#55a868"), (1, 30.0, 2.0, "#c44e52"), (3, 16.0, 8.0, "#e6a157"),
            (4, 1.0, 11.0, "#4c72b0"), (4, 12.0, 21.0, "#55a868")]
    assert bars == want, bars
    events = chrome_trace([rank0, rank1])  # the JSON beside the PNG: the same spans, in us
    spans = sorted((e["pid"], e["tid"], e["name"], round(e["ts"]), round(e["dur"])) for e in events)
    assert len(spans) == 8 and spans[:3] == [("rank 0", "comm", "bucket 0", 15_000, 6_000),
                                             ("rank 0", "comm", "bucket 1", 26_000, 5_000),
                                             ("rank 0", "compute", "backward 0", 10_000, 20_000)]


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
        assert r[7] == f"{last['loss']:.4f}" and r[9].strip(" |").endswith("%"), (r, last)
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
    doc = json.loads(out.with_suffix(".json").read_text())  # the measurements, and the md rendered from them
    assert text == render.markdown(doc["blocks"]) + "\n" and doc["data"]["ratios"]["0.05"][0] > 0
    out = tmp_path / "bench_trainer.md"
    env = {**os.environ, "MINDDP_CACHE": str(tmp_path / "cache")}
    p = launch.script(["-m", "minddp", "bench-trainer", "--repeats", "1", "--rounds", "1", "--steps", "1",
                    "--out", str(out)], 2, env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    text = out.read_text()
    assert "| bare loop |" in text and "| nanoGPT-style loop |" in text
    assert "`agree`" in text and "`opt.step`" in text
    doc = json.loads(out.with_suffix(".json").read_text())
    assert text == render.markdown(doc["blocks"]) + "\n" and set(doc["data"]["ratios"]) == {
        "trainer", "bare loop", "nanoGPT-style loop"}
