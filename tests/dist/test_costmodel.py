"""The cost model: hand-computed values, and predictions against measured gloo times."""


import statistics
from dataclasses import replace

import pytest
import torch

from minddp.perf import costmodel as cm
from minddp.perf.sweep import fit_alpha_beta, run_op
from tests import launch


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
