"""The slowest rank: each rank's own time per step (the step probe's ArrivalClock,
metrics/probe.py), gathered every train.check_every steps on the replica check's all-gather (no
collective of its own), so rank 0 can log the spread."""

from __future__ import annotations

import statistics


def spread(times: dict[int, float]) -> dict:
    """{global rank: seconds} -> the metrics row's rank/* keys."""
    slowest = max(times, key=times.get)
    return {"rank/step_time_min_s": min(times.values()),
            "rank/step_time_median_s": statistics.median(times.values()),
            "rank/step_time_max_s": times[slowest], "rank/slowest": slowest}
