"""The cost model: hand-computed values, and predictions against measured gloo times."""


import math
import statistics

import pytest

from minddp.perf import costmodel as cm
from minddp.perf.memory import memory_per_rank
from minddp.tools import costmodel as costmodel_cli
from minddp.tools.cli import parse_size


def test_formulas_by_hand():
    a, b = 5e-6, 50e9
    # 512 MB over 16 ranks: 2*15*5us = 150 us; 2*15/16 * 512e6 / 50e9 = 19.2 ms
    assert cm.ring_all_reduce_time(512e6, 16, a, b) == pytest.approx(150e-6 + 19.2e-3)
    assert cm.reduce_scatter_time(512e6, 16, a, b) == pytest.approx(75e-6 + 9.6e-3)
    assert cm.all_gather_time(512e6, 16, a, b) == cm.reduce_scatter_time(512e6, 16, a, b)
    assert cm.all_to_all_time(1e9, 8, 1e-6, 1e9) == pytest.approx(7e-6 + 0.875)
    assert cm.broadcast_time(1e9, 8, 1e-6, 1e9) == pytest.approx(3e-6 + 1.0)
    assert cm.tree_all_reduce_time(1e9, 8, 1e-6, 1e9) == pytest.approx(6e-6 + 2.0)
    assert cm.recursive_doubling_all_reduce_time(1e9, 8, 1e-6, 1e9) == pytest.approx(3 * (1e-6 + 1.0))
    assert cm.ring_all_reduce_time(1e9, 1, a, b) == 0.0
    # 2 nodes x 8: reduce in node (3a + M/b_in), ring between 2 leaders, broadcast in node
    t = cm.hierarchical_all_reduce_time(1e9, 2, 8, 1e-6, 100e9, 10e-6, 10e9)
    assert t == pytest.approx((3e-6 + 0.01) + (2 * 10e-6 + 1e9 / 10e9) + (3e-6 + 0.01))


def test_busbw_factors():
    assert cm.busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    assert cm.busbw_factor("reduce_scatter", 4) == cm.busbw_factor("all_gather", 4) == pytest.approx(0.75)
    assert cm.busbw_factor("all_to_all", 4) == pytest.approx(0.75)
    assert cm.busbw_factor("broadcast", 4) == cm.busbw_factor("reduce", 4) == 1.0


def test_ddp_estimate_and_best_bucket():
    c = cm.ddp_comm_time(100e6, 4, 25, 8, 10e-6, 10e9)  # 400 MB in 4 MB tensors, cap 25 MiB
    assert c["buckets"] == math.ceil(100 / 7)  # torch's rule: a bucket closes at 7 x 4 MB >= 25 MiB
    sizes = cm.bucket_bytes(400e6, 25)
    assert all(s >= 25 * 2**20 for s in sizes[:-1]) and sum(sizes) == pytest.approx(400e6)
    assert cm.bucket_bytes(400e6, None)[0] == 4e6  # no cap given: the first closes at 1 MiB (one tensor)
    assert cm.bucket_bytes(400e6, None, 0.4e6)[0] == pytest.approx(1.2e6)  # 3 x 0.4 MB >= 1 MiB
    assert c["latency_s"] == pytest.approx(c["buckets"] * 14 * 10e-6)
    assert c["bandwidth_s"] == pytest.approx(2 * 7 / 8 * 400e6 / 10e9)
    assert c["total_s"] == pytest.approx(c["latency_s"] + c["bandwidth_s"])
    assert cm.exposed_comm(c, backward_s=1.0) == pytest.approx(c["last_bucket_s"])  # hidden but the last
    assert cm.exposed_comm(c, backward_s=0.0) == pytest.approx(c["total_s"])
    assert cm.exposed_comm(c, 1.0, overlap=False) == c["total_s"]
    # the advice is the cheapest candidate, and it moves with the trade-off: cheap latency favours
    # small buckets (little left after backward), expensive latency few large ones
    cost = lambda cap, alpha: cm.predict_ddp_comm(  # noqa: E731
        cm.bucket_bytes(400e6, cap), 8, cm.Calibration(cm.Fabric(alpha, 10e9, "x")), 0.2)["cost_s"]
    caps = (0.25, 1, 5, 25, 100, 250, 1000)
    cap, exposed = cm.best_bucket_mb(100e6, 4, 8, 10e-6, 10e9, backward_s=0.2, candidates=caps)
    assert cap <= 1 and exposed == min(cost(c, 10e-6) for c in caps) < cost(1000, 10e-6) / 50
    cap, exposed = cm.best_bucket_mb(100e6, 4, 8, 10e-3, 10e9, backward_s=0.2, candidates=caps)
    assert cap >= 100 and exposed == min(cost(c, 10e-3) for c in caps) < cost(0.25, 10e-3) / 5


def test_parse_size():
    assert parse_size("512MB") == 512e6 and parse_size("64MiB") == 64 * 2**20
    assert parse_size("124M") == 124e6 and parse_size("8") == 8


def test_the_old_import_path_still_answers():
    """minddp.costmodel is a deprecated re-export of minddp.perf.costmodel, for one release."""
    from minddp import costmodel as old

    assert old.ring_all_reduce_time is cm.ring_all_reduce_time and old.Calibration is cm.Calibration
    assert old.memory_per_rank is memory_per_rank and old.parse_size is parse_size


def test_cli_answers_the_question(capsys):
    costmodel_cli.main(["allreduce", "--size", "512MB", "--n", "16", "--alpha-us", "5", "--beta-gbs", "50"])
    out = capsys.readouterr().out
    assert "0.1500 ms" in out and "19.2000 ms" in out and "bandwidth-dominated" in out


def test_tree_against_ring_by_hand():
    a, b = 5e-6, 50e9
    # n=16, log2 n = 4: whole-message tree 8(a + M/b) vs ring 30a + 1.875 M/b
    assert cm.unpipelined_tree_all_reduce_time(1e6, 16, a, b) == pytest.approx(8 * (a + 1e6 / b))
    m = cm.tree_beats_ring_below(16, a, b)
    assert m == pytest.approx(2 * 11 * a * b / (8 - 1.875))  # 0.898 MB
    for size, tree_wins in ((m / 2, True), (m * 2, False)):
        tree = cm.unpipelined_tree_all_reduce_time(size, 16, a, b)
        ring = cm.ring_all_reduce_time(size, 16, a, b)
        assert (tree < ring) == tree_wins
    assert cm.tree_beats_ring_below(16, a, b, pipelined=True) == pytest.approx(11 * 16 * a * b)  # 44 MB
    assert cm.tree_beats_ring_below(2, a, b) == 0.0  # a ring of two is already one hop


def test_in_switch_reduction_moves_about_half_a_rings_bytes():
    big = 1e11  # bandwidth-bound
    ratio = cm.in_switch_all_reduce_time(big, 72, 3e-6, 900e9) / cm.ring_all_reduce_time(big, 72, 3e-6, 900e9)
    assert ratio == pytest.approx(0.5, abs=0.02)
    assert cm.PRESETS["b200-nvlink5"].beta == 900e9 and cm.PRESETS["ib-xdr"].beta == 100e9


def test_zero1_moves_the_same_bytes_and_shards_the_states():
    d = cm.ddp_comm_time(124e6, 4, 25, 8, 5e-6, 50e9)
    z = cm.zero1_comm_time(124e6, 4, 25, 8, 5e-6, 50e9)
    assert z["reduce_scatter_s"] + z["all_gather_s"] == pytest.approx(d["total_s"])
    plain, sharded = memory_per_rank(124e6, 8), memory_per_rank(124e6, 8, sharded=True)
    assert plain["optimizer_states"] == 8 * 124e6 and sharded["optimizer_states"] == 124e6
    assert sharded["total"] == plain["weights"] + plain["gradients"] + 124e6


def test_bucket_advice_charges_for_each_bucket():
    no_cost = cm.Calibration(cm.Fabric(300e-6, 1.4e9, "x"))
    costly = cm.Calibration(cm.Fabric(300e-6, 1.4e9, "x"), overhead_per_bucket_s=50e-6, contention=1.9)
    # with free, uncontended buckets the smallest cap hides everything under a long backward
    assert cm.best_bucket_mb(10.8e6, 4, 2, 300e-6, 1.4e9, 0.27, calibration=no_cost)[0] <= 1
    # with contention on shared cores, few large buckets win (what make bench measures here)
    assert cm.best_bucket_mb(10.8e6, 4, 2, 300e-6, 1.4e9, 0.27, calibration=costly)[0] >= 25
    assert cm.bucket_bytes(43e6, 25, 0.43e6)[0] >= 25 * 2**20  # torch's rule: at least the cap


def _cal(floor=0.0, contention=1.0, overhead=0.0):
    return cm.Calibration(cm.Fabric(400e-6, 1e9, "x"), overhead, contention, floor)


def test_completion_floor_holds_every_bucket_under_backward_but_the_last():
    sizes, a, b = [2e6, 2e6, 2e6, 1e6], 400e-6, 1e9
    base = cm.predict_ddp_comm(sizes, 2, _cal(), backward_s=1.0)
    floored = cm.predict_ddp_comm(sizes, 2, _cal(floor=3e-3), backward_s=1.0)
    assert base["busy_s"] == pytest.approx(sum(cm.ring_all_reduce_time(s, 2, a, b) for s in sizes))
    assert floored["busy_s"] - base["busy_s"] == pytest.approx(3 * 3e-3)  # 3 under backward
    assert floored["exposed_s"] == base["exposed_s"]  # the last bucket is noticed at once
    # without overlap every bucket is launched after backward, by the waiting thread: no floor
    flat = cm.predict_ddp_comm(sizes, 2, _cal(floor=3e-3), backward_s=1.0, overlap=False)
    assert flat["busy_s"] == pytest.approx(base["busy_s"])
    # the floor is waiting, not work: it takes no CPU from backward
    c = _cal(floor=3e-3, contention=2.0)
    assert cm.predict_ddp_comm(sizes, 2, c, 1.0)["stolen_s"] == pytest.approx(
        cm.predict_ddp_comm(sizes, 2, _cal(contention=2.0), 1.0)["stolen_s"])


def test_zero1_variant_reduce_scatters_each_bucket():
    sizes, a, b = [4e6, 1e6], 400e-6, 1e9
    z = cm.predict_ddp_comm(sizes, 3, _cal(floor=2e-3), backward_s=1.0, op="reduce_scatter")
    assert z["busy_s"] == pytest.approx(cm.reduce_scatter_time(4e6, 3, a, b) + 2e-3
                                        + cm.reduce_scatter_time(1e6, 3, a, b))
    # half an all-reduce's latency and bandwidth terms
    d = cm.predict_ddp_comm(sizes, 3, _cal(), backward_s=1.0)
    assert cm.predict_ddp_comm(sizes, 3, _cal(), 1.0, op="reduce_scatter")["busy_s"] == pytest.approx(
        d["busy_s"] / 2)


def test_zero1_variant_uses_the_reduce_scatters_own_fit():
    slow_rs = cm.Fabric(1e-3, 0.2e9, "gloo's reduce-scatter, measured")
    cal = cm.Calibration(cm.Fabric(400e-6, 1e9, "x"), ops=(("reduce_scatter", slow_rs),))
    z = cm.predict_ddp_comm([4e6], 2, cal, backward_s=1.0, op="reduce_scatter")
    assert z["busy_s"] == pytest.approx(cm.reduce_scatter_time(4e6, 2, 1e-3, 0.2e9))
    d = cm.predict_ddp_comm([4e6], 2, cal, backward_s=1.0)  # the all-reduce keeps its own
    assert d["busy_s"] == pytest.approx(cm.ring_all_reduce_time(4e6, 2, 400e-6, 1e9))


def test_calibration_without_a_floor_still_loads(tmp_path):
    import json

    path = tmp_path / "old.json"
    path.write_text(json.dumps({"alpha": 4e-4, "beta": 1e9, "contention": {"factor": 1.5}}))
    cal = cm.Calibration.load(path)
    assert cal.floor_per_bucket_s == 0.0 and cal.contention == 1.5


def test_the_floor_moves_bucket_advice_to_fewer_buckets():
    # the floor is paid per bucket under backward: with it, small caps stop paying off
    args = (10.8e6, 4, 2, 400e-6, 1e9, 0.27)
    free = cm.best_bucket_mb(*args, calibration=_cal(), tensor_bytes=0.4e6)[0]
    floored = cm.best_bucket_mb(*args, calibration=_cal(floor=3e-3, contention=1.9), tensor_bytes=0.4e6)[0]
    assert floored > free


def test_simulated_buckets_queue_in_order_and_slow_down_under_backward():
    # nothing under backward (it ended before any launch): each bucket takes its alone time
    assert cm.simulate_buckets([1, 1], [0.01, 0.02], 0.0, 4.0) == pytest.approx((0.03, 0.03))
    # launched at 0.5 and 1.0 (half the bytes each) in a 1 s backward, 3x slower until it ends
    busy, end = cm.simulate_buckets([1, 1], [0.1, 0.1], 1.0, 3.0)
    assert busy == pytest.approx(0.3 + 0.1) and end == pytest.approx(1.1)
    # a bucket that outlasts backward finishes its work at full speed: 0.5 s slow = 1/6 done
    busy, end = cm.simulate_buckets([1, 1], [0.4, 0.1], 1.0, 3.0)
    assert end == pytest.approx(1.0 + (0.4 - 0.5 / 3) + 0.1)  # then the last one, queued behind it
    assert busy == pytest.approx(end - 0.5)  # one busy period from the first launch
    # in the calibrated prediction: more buckets under backward, more busy time; the last
    # bucket's share of the exposed time stays its alone time
    # a bucket that starts under backward waits its delay first; one that starts after does not
    busy, end = cm.simulate_buckets([1, 1], [0.1, 0.1], 1.0, 3.0, delay_s=0.05)
    assert busy == pytest.approx(0.05 + 0.3 + 0.1) and end == pytest.approx(1.1)
    cal = cm.Calibration(cm.Fabric(400e-6, 1e9, "x"), under_backward=(("all_reduce", (3.0, 0.0)),))
    few, many = ([8e6, 8e6], [2e6] * 8)
    p_few, p_many = (cm.predict_ddp_comm(x, 2, cal, backward_s=0.2) for x in (few, many))
    assert p_many["busy_s"] > p_few["busy_s"]
    assert p_few["exposed_s"] >= cm.ring_all_reduce_time(8e6, 2, 400e-6, 1e9)


def test_committed_calibration_agrees_with_make_bench_on_the_bucket_cap():
    """The advice from docs/calibration.json (make calibrate) for make bench's GPT at world 2 is
    a cap whose measured step (docs/bench_ddp.json) is within 3% of the fastest one."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    measured = json.loads((docs / "bench_ddp.json").read_text())["data"]["minddp_ms"]  # per repeat
    step_ms = {float(cap): statistics.median(ms) for cap, ms in measured.items()}
    assert set(step_ms) == {1, 5, 25, 100}, measured
    cal = cm.Calibration.load(docs / "calibration.json")
    backward = statistics.median(step_ms.values()) / 1e3 * 2 / 3
    cap, _ = cm.best_bucket_mb(10.8e6, 4, 2, cal.fabric.alpha, cal.fabric.beta, backward,
                               candidates=sorted(step_ms), calibration=cal, tensor_bytes=43.2e6 / 76)
    assert step_ms[cap] <= 1.03 * min(step_ms.values()), (cap, step_ms)


@pytest.mark.parametrize("argv,says", [
    ("allreduce --size 0 --n 4 --preset ib-ndr", "--size 0 is not possible: it must be a finite number > 0"),
    ("allreduce --size=-5MB --n 4 --preset ib-ndr", "--size -5e+06 is not possible"),
    ("allreduce --size 1MB --n 0 --preset ib-ndr", "--n 0 is not possible: it must be a finite number >= 1"),
    ("ddp --params 124M --world -2 --preset ib-ndr", "--world -2 is not possible"),
    ("ddp --params 0 --world 8 --preset ib-ndr", "--params 0 is not possible"),
    ("ddp --params 124M --world 8 --bucket-mb 0 --preset ib-ndr", "--bucket-mb 0 is not possible"),
    ("ddp --params 124M --world 8 --alpha-us 5 --beta-gbs 0", "--beta-gbs 0 is not possible"),
    ("ddp --params 124M --world 8 --alpha-us nan --beta-gbs 5", "--alpha-us nan is not possible"),
    ("zero --params 124M --world 8 --alpha-us 5 --beta-gbs -1", "--beta-gbs -1 is not possible"),
    ("zero --params 124M --world 8 --preset ib-ndr --compute-ms inf", "--compute-ms inf is not possible"),
    ("tree --n 0 --preset ib-ndr", "--n 0 is not possible"),
    ("hier --nodes 0 --per-node 8 --size 1GB", "--nodes 0 is not possible"),
    ("hier --nodes 2 --per-node -8 --size 1GB", "--per-node -8 is not possible"),
])
def test_impossible_sizes_world_sizes_and_bandwidths_are_one_line_exit_2(argv, says, capsys):
    """Issue 45.10: each was a traceback (ZeroDivisionError, ValueError) or a number that means nothing."""
    from minddp.tools import main as tools_main
    from tests.conftest import main_exit

    code, err = main_exit(tools_main, capsys, "costmodel", *argv.split())
    assert code == 2 and says in err and err.count("\n") == 1 and "Traceback" not in err, err
