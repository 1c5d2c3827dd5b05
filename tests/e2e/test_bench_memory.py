"""make bench-memory: what each configuration holds, the peak meter, the issue's criteria, and
one real run of separate torchrun jobs."""


import json

import pytest

from minddp.perf import memory
from tests import launch


@pytest.mark.slow
def test_separate_jobs_report_every_configuration(tmp_path):
    out = tmp_path / "mem"
    p = launch.script(["-m", "minddp", "bench-memory", "--models", "gpt-tiny", "--dp", "2", "--configs",
                    "torch-ddp,minddp-ddp,minddp-zero1", "--steps", "2", "--out", str(out)], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path / "mem.json").read_text())
    assert data["version"]  # the commit measured
    rows = {r["config"]: r for r in data["rows"]}
    # three jobs (what each configuration holds is checked in process above, every configuration)
    assert rows.keys() == {"torch-ddp", "minddp-ddp", "minddp-zero1"}
    for r in rows.values():
        assert [x["rank"] for x in r["ranks"]] == [0, 1] and all(x["peak"] > 0 for x in r["ranks"])
        assert list(r["ranks"][0]["marks"]) == ["init", "model", "wrap", "step1", "step2"]
    states = {c: memory.largest(r, "states") for c, r in rows.items()}
    assert states["minddp-ddp"] == states["torch-ddp"]
    assert states["minddp-zero1"] < 0.6 * states["minddp-ddp"]  # 1/2, plus the per-tensor step counters
    text = (tmp_path / "mem.md").read_text()
    assert "minddp ZeRO-1 vs minddp DDP" in text and "| 2 | minddp-zero1 |" in text
