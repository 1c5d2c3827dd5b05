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
