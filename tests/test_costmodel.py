"""The cost model: hand-computed values, and predictions against measured gloo times."""

import math
import statistics
from dataclasses import replace

import pytest
import torch

from minddp.perf import costmodel as cm
from minddp.perf.memory import memory_per_rank
from minddp.perf.sweep import fit_alpha_beta, run_op
from minddp.tools import costmodel as costmodel_cli
from minddp.tools.cli import parse_size
from tests import launch


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


def _interleaved_rows(sizes, rounds: int) -> list[dict]:
    """The sweep's rows (run_op: the slowest rank's median of 3 calls), its sizes taken in turn
    each round, so that a load that drifts during the sweep hits every size alike; per size the
    median over the rounds (round 0 warms up)."""
    times = {}
    for r in range(rounds + 1):
        for size in sizes:
            row = run_op("all_reduce", [size], torch.float32, warmup=1, iters=3)[0]
            if r:
                times.setdefault(row["size"], []).append(row["time_us"])
    return [{"op": "all_reduce", "size": k, "time_us": statistics.median(v)} for k, v in times.items()]


def _measure(rank, world_size):
    """Predicted / measured time of a size left out of the fit, timed in the same sweeps as the
    fit's sizes, the median of 3 sweeps."""
    probe = 3 * 2**21  # 6 MiB
    sizes = sorted([2**k for k in range(15, 24, 2)] + [probe])  # 32 KiB .. 8 MiB
    ratios, fits = [], []
    for _ in range(3):
        rows = _interleaved_rows(sizes, rounds=6)
        alpha, beta = fit_alpha_beta([r for r in rows if r["size"] != probe], world_size)
        measured = next(r["time_us"] for r in rows if r["size"] == probe) * 1e-6
        ratios.append(cm.ring_all_reduce_time(probe, world_size, alpha, beta) / measured)
        fits.append((alpha, beta))
    return statistics.median(ratios), fits


@pytest.mark.serial  # 4 busy processes on 2 cores time the scheduler, not gloo
def test_alpha_beta_fit_predicts_measured_gloo_time():
    ratio, fits = launch.ranks(_measure, 2, timeout=180)[0]
    assert all(alpha >= 0 and beta > 0 for alpha, beta in fits), fits
    # what the model achieves here: this median (interleaved sweeps) on this 2-core VM, under a
    # load average of 7 to 11 from other sessions' tests, was 0.68 to 0.89 in six runs (0.86 to
    # 1.09 with the same sweeps timed without run_op's per-call setup): the fit predicts the 6 MiB
    # probe 10-30% low. The bounds leave 20% below the lowest and 25% above the highest of those
    # loaded runs (the suite runs this test alone); the old bounds (0.5 to 2) passed a 2x miss
    assert 0.55 <= ratio <= 1.35, (ratio, fits)


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


def _calibrate(rank, world_size, path):
    from minddp.tools.calibrate import write_calibration

    sizes = [2**k for k in range(12, 22, 3)]
    rows = [*run_op("all_reduce", sizes, torch.float32, warmup=1, iters=5),
            *run_op("zero1_reduce_scatter", sizes, torch.float32, warmup=1, iters=5),
            *run_op("zero1_all_gather", sizes, torch.float32, warmup=1, iters=5)]
    assert all(r["wrong"] == 0 for r in rows), rows  # the engine's in-place ZeRO-1 collectives
    tiny = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}  # the floor, quickly: 0.4 MB
    again = [{**r, "time_us": r["time_us"] * 3} for r in rows]  # a slow repeat: the median is between
    cal = write_calibration(path, rows, world_size, torch.device("cpu"), more_rows=[again, again],
                            floor={"model_cfg": tiny, "cap_mb": 0.05}, under={"caps": (0.05, 0.1), "reps": 3})
    assert cal["repeats"] == 3
    assert cal["alpha"] == pytest.approx(3 * fit_alpha_beta([r for r in rows if r["op"] == "all_reduce"],
                                                            world_size)[0])  # the median: a slow one
    return cal


@pytest.mark.slow  # a real (quick) calibration: seconds
def test_calibration_round_trip_and_the_calibrated_prediction(tmp_path):
    path = tmp_path / "calibration.json"
    cal_dict = launch.ranks(_calibrate, 2, str(path), timeout=180)[0]
    cal = cm.Calibration.load(path)  # written by rank 0, read back
    assert cal.fabric.alpha == cal_dict["alpha"] and cal.fabric.beta == cal_dict["beta"]
    assert cal.contention >= 1.0 and cal.overhead_per_bucket_s > 0
    assert cal.floor_per_bucket_s == cal_dict["floor"]["per_bucket_s"] > 0
    assert cal_dict["floor"]["buckets"] > 1  # measured over several buckets at world 1
    rs = cal.fabric_for("reduce_scatter")  # the engine's own reduce-scatter's fit, read back
    fit = cal_dict["ops"]["zero1_reduce_scatter"]
    assert cal_dict["ops"]["reduce_scatter"] == fit and "all_gather" in cal_dict["ops"]
    assert (rs.alpha, rs.beta) == (fit["alpha"], fit["beta"]) and rs != cal.fabric
    for op in ("all_reduce", "reduce_scatter"):  # fitted from the engine at several bucket layouts
        fit = cal_dict["under_backward"][op]
        assert cal.slowdown_for(op) == (fit["slowdown"], fit["delay_s"]) and fit["slowdown"] >= 1.0
        assert len({len(p["bucket_bytes"]) for p in fit["points"]}) == 2
        assert all(p["busy_s"] > 0 and p["backward_s"] > 0 for p in fit["points"])
    assert 0 < cal.backward_share < 1
    cal = replace(cal, under_backward=())  # below: the per-bucket formula, without the simulation
    a, b = cal.fabric.alpha, cal.fabric.beta
    ring = lambda m: cm.ring_all_reduce_time(m, 2, a, b)  # noqa: E731
    # one bucket: launched when backward ends, so no contention; plus the engine's cost
    one = cm.predict_ddp_comm([4e6], 2, cal, backward_s=1.0)
    assert one["busy_s"] == pytest.approx(ring(4e6) + cal.overhead_per_bucket_s)
    # two buckets: the first runs under backward, slowed by contention, and takes CPU from it
    two = cm.predict_ddp_comm([4e6, 1e6], 2, cal, backward_s=1.0)
    first = ring(4e6) * cal.contention + cal.overhead_per_bucket_s
    floor = cal.floor_per_bucket_s  # held in flight until noticed: under backward only
    assert two["busy_s"] == pytest.approx(first + floor + ring(1e6) + cal.overhead_per_bucket_s)
    assert two["exposed_s"] == pytest.approx(ring(1e6) + cal.overhead_per_bucket_s)  # the last bucket
    assert two["stolen_s"] == pytest.approx(first * (1 - 1 / cal.contention))


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

    docs = Path(__file__).resolve().parents[1] / "docs"
    measured = json.loads((docs / "bench_ddp.json").read_text())["data"]["minddp_ms"]  # per repeat
    step_ms = {float(cap): statistics.median(ms) for cap, ms in measured.items()}
    assert set(step_ms) == {1, 5, 25, 100}, measured
    cal = cm.Calibration.load(docs / "calibration.json")
    backward = statistics.median(step_ms.values()) / 1e3 * 2 / 3
    cap, _ = cm.best_bucket_mb(10.8e6, 4, 2, cal.fabric.alpha, cal.fabric.beta, backward,
                               candidates=sorted(step_ms), calibration=cal, tensor_bytes=43.2e6 / 76)
    assert step_ms[cap] <= 1.03 * min(step_ms.values()), (cap, step_ms)


def _engine_buckets(rank, world_size):
    from torch import nn

    from minddp import DistributedDataParallel
    from minddp.engine.buckets import TensorSpec

    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    params = list(model.parameters())
    planned = cm.planned_bytes([TensorSpec.of(p) for p in params], 0.02, list(reversed(range(len(params)))))
    return planned, [float(b.grad_nbytes) for b in ddp.layout.buckets]


def test_the_cost_models_buckets_are_the_engines():
    """perf plans with minddp.engine.buckets itself: the bytes per bucket the engine builds."""
    planned, built = launch.ranks(_engine_buckets, 2)[0]
    assert len(planned) > 2 and planned == built, (planned, built)
