"""The collective benchmark checks every result, and the scaling study runs end to end."""


import json

import pytest

from minddp.perf.sweep import fit_alpha_beta
from tests.files import line_data, md_rows

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
                  "--out", str(tmp_path / "scaling"), "--preset", "this-machine-gloo"])
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
