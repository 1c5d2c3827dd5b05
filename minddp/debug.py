"""Never hang silently: a flight recorder and collective fingerprints, on any backend.

`enable(record=N, fingerprints=bool)` wraps torch.distributed's collectives (all_reduce,
broadcast, reduce, all_gather(_into_tensor), reduce_scatter_tensor, all_to_all_single,
barrier, all_gather_object, broadcast_object_list). Off, nothing is wrapped: zero cost.

- Flight recorder: every rank keeps its last N collectives (sequence number per group, op,
  dtype, shape, group ranks, start and end time, state). `dump(dir)` writes
  `<dir>/flight_recorder/rank<r>.json`; the trainer does it on any exception, on SIGTERM and
  on a collective timeout. `python -m minddp.debug <run dir>` reads every rank's dump and
  says who is stuck on which collective while the others moved on.
- Fingerprints: before each collective, ranks publish (sequence, op, dtype, shape, group)
  in the process group's store and read each other's; a mismatch raises on every rank
  with both fingerprints ("rank 1 called broadcast(shape [8]) at #57 while rank 0 called
  all_reduce(shape [4])"), and a rank that never arrives is named after `timeout_s`.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import _compat


class CollectiveMismatchError(RuntimeError):
    pass


_WRAPPED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
            "reduce_scatter_tensor", "all_to_all_single", "barrier", "all_gather_object",
            "broadcast_object_list")
_state = {"originals": {}, "recorder": None, "fingerprints": False, "timeout_s": 60.0,
          "seq": collections.Counter(), "lock": threading.Lock(), "in_check": threading.local()}


def enabled() -> bool:
    return bool(_state["originals"])


def enable(record: int = 2000, fingerprints: bool = False, timeout_s: float = 60.0) -> None:
    """Wrap the collectives (idempotent). record: ring-buffer length (0: no recorder)."""
    _state["recorder"] = collections.deque(maxlen=record) if record else None
    _state["fingerprints"], _state["timeout_s"] = fingerprints, timeout_s
    for name in _WRAPPED:
        if name not in _state["originals"]:
            original = getattr(dist, name)
            _state["originals"][name] = original
            setattr(dist, name, _wrap(name, original))


def disable() -> None:
    for name, original in _state["originals"].items():
        setattr(dist, name, original)
    _state["originals"].clear()
    _state["recorder"] = None
    _state["seq"].clear()


def _describe(name, args, kwargs):
    tensor = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        lists = [a for a in args if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)]
        tensor = lists[0][0] if lists else None
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    group = group or dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    shape = list(tensor.shape) if tensor is not None else []
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "object"
    return group, ranks, shape, dtype


def _wrap(name, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        local = _state["in_check"]
        if getattr(local, "busy", False):  # our own bookkeeping (e.g. object collectives inside)
            return original(*args, **kwargs)
        local.busy = True
        try:
            group, ranks, shape, dtype = _describe(name, args, kwargs)
            with _state["lock"]:
                _state["seq"][ranks] += 1
                seq = _state["seq"][ranks]
            if _state["fingerprints"] and len(ranks) > 1:
                _check_fingerprint(group, ranks, seq, (name, dtype, shape))
            entry = {"seq": seq, "op": name, "dtype": dtype, "shape": shape, "group": list(ranks),
                     "start": time.time(), "end": None, "state": "started"}
            rec = _state["recorder"]
            if rec is not None:
                rec.append(entry)
        finally:
            local.busy = False
        try:
            result = original(*args, **kwargs)
        except BaseException:
            entry["state"] = "failed"
            raise
        if kwargs.get("async_op") and result is not None:
            # no callback on the comm thread (it could outlive the process group at exit):
            # the work is polled when the recorder is dumped
            entry["work"] = result
        else:
            entry["end"], entry["state"] = time.time(), "completed"
        return result

    return wrapper


def _fmt(rank, fp, seq):
    op, dtype, shape = fp
    return f"rank {rank} called {op}({dtype}, shape {shape}) at #{seq}"


def _check_fingerprint(group, ranks, seq, fp) -> None:
    store = _compat.default_store()
    me = dist.get_rank()
    tag = "-".join(map(str, ranks))
    key = lambda r, s: f"minddp/fp/{tag}/{s}/{r}"  # noqa: E731
    store.set(key(me, seq), json.dumps(fp))
    peers = [r for r in ranks if r != me]
    try:
        store.wait([key(r, seq) for r in peers], timedelta(seconds=_state["timeout_s"]))
    except Exception:  # noqa: BLE001 - store timeouts have several types across versions
        missing = [r for r in peers if not store.check([key(r, seq)])]
        raise CollectiveMismatchError(
            f"{_fmt(me, fp, seq)} in group {list(ranks)}, but rank(s) {missing} did not reach "
            f"collective #{seq} within {_state['timeout_s']:g}s: they are stuck earlier or took a "
            "different code path (a collective inside `if rank == ...`?)") from None
    theirs = {r: tuple(json.loads(store.get(key(r, seq)))) for r in peers}
    theirs[me] = tuple(json.loads(json.dumps(fp)))
    first = ranks[0]
    for r in ranks:
        if theirs[r] != theirs[first]:
            raise CollectiveMismatchError(
                f"collective mismatch in group {list(ranks)}: {_fmt(r, theirs[r], seq)} while "
                f"{_fmt(first, theirs[first], seq)}. Every rank must call the same collectives in "
                "the same order; branch on the rank only after them.")
    if seq > 2:  # every peer has read it: they all published seq-1, so they checked seq-2
        store.delete_key(key(me, seq - 2))


def dump(run_dir, reason: str = "") -> Path | None:
    """Write this rank's flight recorder to <run_dir>/flight_recorder/rank<r>.json."""
    rec = _state["recorder"]
    if rec is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    d = Path(run_dir) / "flight_recorder"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank{rank}.json"
    entries = []
    for e in list(rec):
        e = dict(e)
        work = e.pop("work", None)
        if work is not None and e["state"] == "started" and work.is_completed():
            e["state"] = "completed"  # async: finished, end time not observed
        entries.append(e)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "reason": reason, "time": time.time(),
                               "entries": entries}, indent=0))
    os.replace(tmp, path)
    return path


def analyze(run_dir) -> str:
    """Who is stuck where: compare every rank's last collectives, group by group."""
    dumps = {}
    for p in sorted((Path(run_dir) / "flight_recorder").glob("rank*.json")):
        d = json.loads(p.read_text())
        dumps[d["rank"]] = d
    if not dumps:
        return f"no flight recorder dumps under {run_dir}/flight_recorder"
    lines = [f"flight recorder dumps from ranks {sorted(dumps)}"
             + (f" (reasons: {sorted({d['reason'] for d in dumps.values() if d['reason']})})" or "")]
    groups = sorted({tuple(e["group"]) for d in dumps.values() for e in d["entries"]})
    for g in groups:
        last = {}
        for r, d in dumps.items():
            mine = [e for e in d["entries"] if tuple(e["group"]) == g]
            if mine:
                last[r] = mine[-1]
        if not last:
            continue
        top = max(e["seq"] for e in last.values())
        lines.append(f"group {list(g)}: furthest collective #{top}")
        for r in g:
            e = last.get(r)
            if e is None:
                lines.append(f"  rank {r}: no dump or no collective in this group (dead or never started?)")
                continue
            desc = f"#{e['seq']} {e['op']}({e['dtype']}, shape {e['shape']}) {e['state']}"
            if e["state"] != "completed":
                lines.append(f"  rank {r}: STUCK in {desc}" + (
                    "" if e["seq"] == top else f" while others moved on to #{top}"))
            elif e["seq"] < top:
                lines.append(f"  rank {r}: last {desc}: never called #{e['seq'] + 1}, "
                             "which the others are waiting in")
            else:
                lines.append(f"  rank {r}: {desc}")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m minddp.debug <run dir>\n\n" + __doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    print(analyze(argv[0]))


if __name__ == "__main__":
    main()
