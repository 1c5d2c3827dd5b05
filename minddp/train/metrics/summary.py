"""A run's steady state, from its metrics rows: what `summary.json`, W&B's summary and
`minddp report` all hold, computed by this one function so that they agree.

Steady state: the rows after the first fifth of the logged ones (warm-up: the first steps
build buckets, fill caches and compile). Medians over those rows; `val_loss` is the last
evaluation, `best_val_loss` the lowest; `rank/slowest` is the rank that was slowest most often.
How it ended: `status` is "non-finite" when the last logged step was skipped or its loss was
NaN/inf (the run stopped on it: train.on_nonfinite=stop, train.max_skipped_steps), else "ok";
`loss` is the last loss as it was (null when non-finite, never an older finite one, which is
`last_finite_loss`), `skipped_steps` the run's skipped steps.
"""

from __future__ import annotations

import statistics
from collections import Counter

# medians over the steady rows, under the metrics' own names (W&B shows them as its summary)
STEADY = ("step_time_s", "tokens_per_s", "tflops", "mfu", "comm/busy_s", "comm/exposed_wait_s",
          "comm/exposed_fraction", "rank/step_time_min_s", "rank/step_time_median_s",
          "rank/step_time_max_s", "machine/load_1min")
# every key summary() may write: W&B keeps these as set here, not as the last logged row
KEYS = (*STEADY, "comm/busy_fraction", "rank/slowest", "loss", "val_loss", "best_val_loss",
        "mem/peak_rss_mb", "steps", "warmup_rows", "steady_rows", "status", "skipped_steps",
        "last_finite_loss")


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def steady_rows(rows: list[dict]) -> list[dict]:
    return rows[len(rows) // 5:] or rows


def _median(rows: list[dict], key: str):
    values = [r[key] for r in rows if number(r.get(key))]
    return statistics.median(values) if values else None


def summary(rows: list[dict]) -> dict:
    """The steady-state numbers of a run's rows (in step order, one per logged step)."""
    if not rows:
        return {}
    steady = steady_rows(rows)
    out = {k: _median(steady, k) for k in STEADY}
    busy = [r["comm/busy_s"] / r["step_time_s"] for r in steady
            if number(r.get("comm/busy_s")) and number(r.get("step_time_s")) and r["step_time_s"] > 0]
    out["comm/busy_fraction"] = statistics.median(busy) if busy else None
    if out["mfu"] is not None and out["mfu"] > 1:  # an underestimated peak: not a utilisation
        out["mfu"] = None
    slowest = [r["rank/slowest"] for r in rows if number(r.get("rank/slowest"))]
    out["rank/slowest"] = Counter(slowest).most_common(1)[0][0] if slowest else None
    losses = [r["loss"] for r in rows if number(r.get("loss"))]
    vals = [r["val_loss"] for r in rows if number(r.get("val_loss"))]
    rss = [r["mem/peak_rss_mb"] for r in rows if number(r.get("mem/peak_rss_mb"))]
    out.update({"last_finite_loss": losses[-1] if losses else None, "val_loss": vals[-1] if vals else None,
                "best_val_loss": min(vals) if vals else None, "mem/peak_rss_mb": max(rss) if rss else None,
                "steps": rows[-1].get("step"), "warmup_rows": len(rows) - len(steady),
                "steady_rows": len(steady)})
    out = {k: v for k, v in out.items() if v is not None}
    return {**out, **ending(rows)}


def ending(rows: list[dict]) -> dict:
    """How the run ended: its last loss as it was (None: NaN/inf), the skipped steps (the
    trainer's count, carried across resumes), and whether it stopped on a non-finite step."""
    last = rows[-1]
    counts = [r["skipped_steps"] for r in rows if number(r.get("skipped_steps"))]
    before = next((r["skipped_steps"] for r in reversed(rows[:-1]) if number(r.get("skipped_steps"))), 0)
    last_skipped = number(last.get("skipped_steps")) and last["skipped_steps"] > before
    loss = last.get("loss") if number(last.get("loss")) else None
    nonfinite = ("loss" in last and loss is None) or last_skipped
    return {"status": "non-finite" if nonfinite else "ok", "skipped_steps": max(counts) if counts else 0,
            **({"loss": loss} if "loss" in last else {})}
