"""Never hang, never lose work: fingerprints, flight recorder, consistency, bad input."""


import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minddp.train.metrics import flight_recorder
from minddp.train.safety import consistency
from tests import launch


# ------------------------------------------- fingerprints (torch's DETAIL mode)
def _mismatch(rank, world_size):
    flight_recorder.enable_fingerprints()
    checked = dist.new_group(timeout=timedelta(seconds=20))  # groups created from now on are checked
    dist.all_reduce(torch.ones(2), group=checked)  # #1 agrees
    if rank == 0:
        dist.all_reduce(torch.ones(4), group=checked)
    else:
        dist.broadcast(torch.ones(8), src=0, group=checked)


def test_collective_mismatch_names_ranks_and_both_calls():
    errors = launch.ranks_expect_errors(_mismatch, 2, timeout=60)
    for text in errors.values():
        assert "Detected mismatch between collectives" in text
        assert "OpType=ALLREDUCE, TensorShape=[4]" in text and "OpType=BROADCAST, TensorShape=[8]" in text


# ------------------------------------------------- torch's flight recorder
def _hang(rank, world_size, run_dir, late_s=None):
    """Rank 0 waits in #4 until its 2 s timeout; rank 1 never calls it, or (late_s) calls it
    only that long after (a stall that ends before anyone kills the rank)."""
    import time

    short = dist.new_group(timeout=timedelta(seconds=2))
    flight_recorder.register_groups(short)
    flight_recorder.set_context(step=7, phase="test")
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(3), group=short)
        if rank == 1 and late_s:
            time.sleep(late_s)
        if rank == 0 or late_s:
            dist.all_reduce(torch.ones(5), group=short)  # rank 1 never comes (in time): times out
    except RuntimeError as e:
        flight_recorder.dump(run_dir, f"{type(e).__name__}: {e}")
        return "timed out"
    finally:
        if rank == 1:
            flight_recorder.dump(run_dir, "moved on")
    return "done"


def test_flight_recorder_dump_read_back_by_the_debug_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")  # the forked ranks start torch's recorder
    assert launch.ranks(_hang, 2, str(tmp_path), timeout=60) == ["timed out", "done"]
    assert {p.name for p in (tmp_path / "flight_recorder").iterdir()} == {"rank0", "rank1"}
    from minddp.tools import main as minddp_cli

    monkeypatch.setattr("sys.argv", ["minddp"])  # the dispatcher hands the tool its own argv
    with pytest.raises(SystemExit) as usage:  # `minddp debug` without a run dir: usage, exit 2
        minddp_cli(["debug"])
    assert usage.value.code == 2
    minddp_cli(["debug", str(tmp_path)])  # what `minddp debug <run dir>` prints, in-process
    out = capsys.readouterr().out
    assert "ranks [0] are in #4 all_reduce(float32, shape [5]); ranks [1] never called it" in out, out
    assert "rank 1: last #3 all_reduce(float32, shape [3]): never called #4, which ranks [0] are waiting in" \
        in out, out
    assert "rank 0: dumped at step 7 (test): RuntimeError" in out
    # what torch's dump lacks on gloo and minddp's context adds: the group's members
    ctx = json.loads((tmp_path / "flight_recorder_context" / "rank0.json").read_text())
    assert [0, 1] in ctx["groups"].values()
    # a rank whose only dump is nccl's watchdog's (killed before minddp dumped) is still read
    (tmp_path / "flight_recorder" / "rank1").rename(tmp_path / "flight_recorder" / "watchdog_rank1")
    minddp_cli(["debug", str(tmp_path)])
    assert "ranks [1] never called it" in capsys.readouterr().out


def test_a_rank_that_reaches_the_collective_after_the_timeout_never_called_it(tmp_path, monkeypatch, capsys):
    """The stuck rank's stall ends before a launcher's SIGTERM reaches it: its dump shows it in
    the collective too, but it entered 4 s after rank 0, past rank 0's 2 s timeout (the race
    of test_stuck_rank_ends_every_rank_and_the_dumps_name_the_collective under load)."""
    from minddp.tools import debug

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    assert launch.ranks(_hang, 2, str(tmp_path), 4.0, timeout=60) == ["timed out", "timed out"]
    debug.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "ranks [0] are in #4 all_reduce(float32, shape [5]); ranks [1] never called it in time" in out, out
    line = next(x for x in out.splitlines() if x.startswith("  rank 1: reached #4"))
    late = float(line.split(" s after rank 0")[0].rsplit(" ", 1)[1])
    assert 4.0 <= late < 30 and line.endswith("past its 2 s timeout: stuck before it"), line


# ---------------------------------------------------------------- consistency
def _diverge(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    consistency.check_replicas(model)  # identical: passes
    if rank == 1:
        with torch.no_grad():
            model[1].bias[0] += 1e-6
    consistency.check_replicas(model)


def test_replica_divergence_names_the_parameter_on_every_rank():
    errors = launch.ranks_expect_errors(_diverge, 2, timeout=60)
    for text in errors.values():
        assert "parameter '1.bias' differs between rank 0 and rank(s) [1]" in text
