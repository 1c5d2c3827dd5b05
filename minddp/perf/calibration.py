"""The fits `minddp calibrate` makes from its measurements (the measurements themselves run the
engine on make scaling's GPT: minddp/tools/calibrate.py):

- alpha and beta per collective from the sweep's rows (sweep.fit_alpha_beta); the engine's own
  ZeRO-1 collectives (zero1_*) stand for reduce-scatter and all-gather;
- the under-backward slowdown and delay: a grid search for the pair with which
  `costmodel.simulate_buckets` gives the busy times the engine showed at several caps;
- repeats combined: the median of each figure, or the middle one of a measurement whose parts
  belong together.
"""

from __future__ import annotations

import math
import statistics

from .costmodel import BUCKET_OPS, simulate_buckets
from .sweep import fit_alpha_beta


def fit_ops(rows: list[dict], n: int) -> tuple[float, float, dict]:
    """(alpha, beta) of the all-reduce, and {op: {"alpha", "beta"}} of every other op swept."""
    alpha, beta = fit_alpha_beta([r for r in rows if r["op"] == "all_reduce"], n)
    ops = {}
    for op in sorted({r["op"] for r in rows} - {"all_reduce"}):
        a, b = fit_alpha_beta([r for r in rows if r["op"] == op], n)
        ops[op] = {"alpha": a, "beta": b}
    for op in [op for op in ops if op.startswith("zero1_")]:
        ops[op.removeprefix("zero1_")] = ops[op]  # what the cost model's reduce-scatter means here
    return alpha, beta, ops


# slowdown x1.05^k (x1 to x17) and delay d * 0.25 ms (0 to 20 ms)
GRID = [(1.05 ** k, d * 2.5e-4) for k in range(60) for d in range(80)]


def fit_under_backward(points: list[dict], alone: tuple[float, float], op: str,
                       n: int) -> tuple[float, float]:
    """(slowdown, delay_s) on GRID whose simulated busy times are closest, in log ratio, to the
    measured `points` ({"bucket_bytes", "backward_s", "busy_s"} per cap), each bucket's work
    being the `alone` (alpha, beta) fit's time for `op`."""
    cost = BUCKET_OPS[op]

    def error(guess: tuple[float, float]) -> float:
        total = 0.0
        for p in points:
            work = [cost(b, n, *alone) for b in p["bucket_bytes"]]
            busy = simulate_buckets(p["bucket_bytes"], work, p["backward_s"], *guess)[0]
            total += math.log(busy / p["busy_s"]) ** 2
        return total

    return min(GRID, key=error)


def combine(runs: list[dict]) -> dict:
    """One calibration from repeated ones: the median alpha, beta and engine cost; per op the
    median fit; the floor, contention and each under-backward fit the middle measurement."""
    cal = {**runs[0], "repeats": len(runs), "alpha": _median(runs, "alpha"), "beta": _median(runs, "beta"),
           "overhead_per_bucket_s": _median(runs, "overhead_per_bucket_s")}
    cal["ops"] = {op: {k: _median([r["ops"][op] for r in runs], k) for k in ("alpha", "beta")}
                  for op in runs[0]["ops"]}
    cal["floor"] = _middle([r["floor"] for r in runs], "per_bucket_s")
    cal["contention"] = _middle([r["contention"] for r in runs], "factor")
    if "under_backward" in cal:
        cal["under_backward"] = {op: _middle([r["under_backward"][op] for r in runs], "slowdown")
                                 for op in runs[0]["under_backward"]}
    return cal


def _median(dicts: list[dict], key: str) -> float:
    return statistics.median(d[key] for d in dicts)


def _middle(dicts: list[dict], key: str) -> dict:
    """The measurement whose `key` is the median (the lower middle one of an even count)."""
    return sorted(dicts, key=lambda d: d[key])[(len(dicts) - 1) // 2]
