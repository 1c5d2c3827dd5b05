"""make bench-memory: what each configuration holds, the peak meter, the issue's criteria, and
one real run of separate torchrun jobs."""


import pytest
import torch

from minddp.perf import memory
from minddp.tools import bench_memory as bm

P = 100e6  # bytes of fp32 parameters


def test_what_each_configuration_holds():
    total = {c: memory.modeled_bytes(c, P, 2)["total"] / P for c in memory.CONFIGS}
    assert total["local"] == 4  # params, grads, AdamW's two states
    assert total["torch-ddp"] == 5  # + the reducer's buckets beside param.grad
    assert total["torch-ddp-view"] == total["minddp-ddp"] == total["minddp-overlap"] == 4  # grads are views
    assert total["minddp-zero1"] == 3  # states / 2
    assert total["torch-zero"] == 4  # torch DDP's 5P, states / 2
    assert memory.modeled_bytes("minddp-zero1", P, 3)["states"] == pytest.approx(2 * P / 3)
    for c in memory.CONFIGS:  # the words in the table say what the numbers are
        parts = memory.modeled_bytes(c, P, 2)
        assert ("grads P" in memory.HOLDS[c][4]) == (parts["grads"] > 0), c
        assert ("states 2P/dp" in memory.HOLDS[c][4]) == (parts["states"] < 2 * P), c


def _row(config, peak_mb, states_mb, dp=2, model="gpt-10.8M"):
    rank = {"peak": peak_mb * 1e6, "states": states_mb * 1e6, "absolute": (peak_mb + 500) * 1e6,
            "param_bytes": 43e6, "marks": {"init": 0, "model": 43e6, "wrap": 90e6, "step1": peak_mb * 1e6},
            "method": "VmHWM - RSS after import", "device": "cpu"}
    return {"config": config, "model": model, "dp": dp, "ranks": [rank, {**rank, "peak": 1e6}]}


def test_zero1_criterion_is_80_percent_of_the_states_saved():
    # saved 43 MB: lowering the peak by 35 MB passes (>= 34.4), by 30 MB fails
    ok = memory.zero_criterion([_row("minddp-ddp", 300, 86), _row("minddp-zero1", 265, 43)],
                           "minddp-ddp", "minddp-zero1")
    assert ok["saved"] == pytest.approx(43e6) and ok["lowered"] == pytest.approx(35e6) and ok["pass"]
    bad = memory.zero_criterion([_row("minddp-ddp", 300, 86), _row("minddp-zero1", 270, 43)],
                            "minddp-ddp", "minddp-zero1")
    assert not bad["pass"] and bad["fraction"] == pytest.approx(30 / 43)
    assert memory.zero_criterion([_row("minddp-ddp", 300, 86)], "minddp-ddp", "minddp-zero1") is None


def test_report_shows_the_largest_rank_and_both_verdicts():
    rows = [_row("torch-ddp", 320, 86), _row("minddp-ddp", 300, 86), _row("minddp-zero1", 330, 43),
            {"config": "minddp-overlap", "model": "gpt-10.8M", "dp": 2, "skipped": "no option"}]
    text = bm.report(rows, steps=3)
    line = next(x for x in text.splitlines() if x.startswith("| 2 | minddp-zero1 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3:7] == ["129", "43", "47", "330"]  # modeled 3P, states, wrap raised, the largest rank
    assert "| gpt-10.8M | 2 | minddp ZeRO-1 vs minddp DDP | 43 | 300 | 330 | -30 | -0.70 | FAIL |" in text
    assert "| gpt-10.8M | 2 | 320 | - | 300 | pass |" in text  # minddp DDP at or below torch's default
    assert "no option" in text


def test_peak_meter_sees_an_allocation_after_its_baseline():
    meter = memory.PeakMeter()
    if not meter.reset:
        pytest.skip("this kernel does not reset VmHWM (clear_refs): ru_maxrss is the process's lifetime peak")
    x = torch.ones(50_000_000)  # 200 MB, touched
    del x
    assert meter.peak() >= 190e6
    assert memory.PeakMeter().peak() < 50e6  # a new meter starts from the resident set now


def test_a_small_model_gets_no_verdict_below_the_meters_resolution_and_no_zero_sizes():
    """issue 56.12: gpt-tiny read "0.0M parameters, P = 0 MB", "-0" and FAIL on 0 MB of states saved."""
    def tiny(config, peak_mb, states_mb):
        row = _row(config, peak_mb, states_mb, model="gpt-tiny")
        for rank in row["ranks"]:
            rank["param_bytes"] = 0.36e6  # 90K parameters
        return row

    rows = [tiny("torch-ddp", 17, 0.72), tiny("minddp-ddp", 18, 0.72), tiny("minddp-zero1", 17.9, 0.36),
            tiny("torch-zero", 17.1, 0.36)]
    text = bm.report(rows, steps=1)
    assert "## gpt-tiny: 90.0K parameters, P = 0.36 MB, AdamW states 2P = 0.72 MB" in text, text
    na = "| - | n/a (under 4 MB) |"
    assert f"| gpt-tiny | 2 | minddp ZeRO-1 vs minddp DDP | 0.36 | 18 | 18 | 0.10 {na}" in text, text
    assert f"| torch ZeroRedundancyOptimizer vs torch DDP | 0.36 | 17 | 17 | -0.10 {na}" in text
    assert "| gpt-tiny | 2 | 17 | - | 18 | n/a (under 4 MB) |" in text, text
    assert "FAIL" not in text and "| -0 |" not in text and "0.0M" not in text


def test_sizes_print_as_what_they_are():
    from minddp.tools import render

    assert [render.count(n) for n in (10.8e6, 90e3, 512)] == ["10.8M", "90.0K", "512"]
    assert [render.megabytes(b) for b in (43e6, 0.36e6, -0.001e6, 0)] == ["43", "0.36", "0.00", "0.00"]
    assert render.megabytes(17e6, signed=True) == "+17" and render.megabytes(-30e6, signed=True) == "-30"


def test_bench_ddp_prints_no_sentinel_or_negative_cost():
    """A cap torch logged no rebuild for printed its bucket count as -1; a per-bucket cost within
    the timer's noise as a negative number of microseconds."""
    from minddp.tools import bench_ddp

    assert bench_ddp.per_bucket(21.9e-6) == "21.9"
    assert bench_ddp.per_bucket(-32.4e-6) == "under the timer's noise"
    buckets = {("minddp", 1.0): 1, ("torch DDP", 1.0): None}
    [row] = bench_ddp.cap_rows([1.0], {1.0: [1.1]}, buckets, {1.0: [9.0]})
    assert row[:2] == ["1", "1 / not logged"], row
