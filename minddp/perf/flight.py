"""Who is stuck where, from every rank's flight-recorder dump (`minddp debug` is its command line).

The dumps are torch's own (written by minddp.train.metrics.flight_recorder on an exception, a
collective timeout or SIGTERM), plus minddp's context per rank (step, phase, group ranks).
The answer names, group by group, each rank's last collective and who never called the
one the others wait in.
"""

from __future__ import annotations

import json
from pathlib import Path

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}


class DumpError(ValueError):
    """A dump that is not torch's flight-recorder format (torn, truncated, another file)."""


_ENTRY_KEYS = ("profiling_name", "input_dtypes", "input_sizes", "collective_seq_id", "process_group",
               "is_p2p")


def _read(p: Path, reader):
    try:
        return reader(p)
    except Exception as e:  # noqa: BLE001 - any failure to parse is this file's fault
        raise DumpError(f"{p}: not a readable dump ({type(e).__name__}: {str(e)[:120]})") from None


def _entry_ok(e) -> bool:
    return (isinstance(e, dict) and all(k in e for k in _ENTRY_KEYS)
            and isinstance(e["process_group"], (list, tuple)) and isinstance(e["collective_seq_id"], int))


def _check_dump(p: Path, d) -> dict:
    entries = d.get("entries") if isinstance(d, dict) else None
    if not isinstance(entries, list) or not all(_entry_ok(e) for e in entries):
        raise DumpError(f"{p}: not torch's flight-recorder format (needs 'entries', each with "
                        f"{', '.join(_ENTRY_KEYS)})")
    return d


def _context_ok(c) -> bool:
    return (isinstance(c, dict) and isinstance(c.get("rank"), int) and isinstance(c.get("world_size", 0), int)
            and isinstance(c.get("groups", {}), dict))


def load_dumps(run_dir, unpickle) -> tuple[dict[int, dict], dict[int, dict]]:
    """({rank: torch's dump}, {rank: minddp's context}) from a run directory, each dump read by
    `unpickle(path)` (the caller's restricted unpickler); DumpError names a file that is not one."""
    dumps, contexts, folder = {}, {}, Path(run_dir) / "flight_recorder"
    # minddp's own dump first; nccl's watchdog writes watchdog_rank<r> on a timeout, and that
    # one is all there is of a rank killed before minddp could dump
    for prefix in ("rank", "watchdog_rank"):
        for p in sorted(folder.glob(f"{prefix}*")):
            r = p.name[len(prefix):]
            if r.isdigit() and int(r) not in dumps:
                dumps[int(r)] = _check_dump(p, _read(p, unpickle))
    for p in sorted((Path(run_dir) / "flight_recorder_context").glob("rank*.json")):
        c = _read(p, lambda q: json.loads(q.read_text()))
        if not _context_ok(c):
            raise DumpError(f"{p}: not minddp's context file (needs an integer 'rank' and 'world_size')")
        contexts[c["rank"]] = c
    return dumps, contexts


def describe(entry: dict) -> str:
    op = entry["profiling_name"].split(":")[-1]
    dtypes = ",".join(_DTYPES.get(d, d) for d in entry["input_dtypes"]) or "-"
    shapes = entry["input_sizes"]
    shape = shapes[0] if len(shapes) == 1 else shapes
    return f"#{entry['collective_seq_id']} {op}({dtypes}, shape {list(shape)})"


def _members(pg: str, dumps, contexts) -> list[int]:
    for c in contexts.values():
        if pg in c.get("groups", {}):
            return c["groups"][pg]
    if pg == "0":  # the default group: every rank
        world = max([c.get("world_size", 0) for c in contexts.values()] + [max(dumps) + 1])
        return list(range(world))
    return sorted(r for r, d in dumps.items() if any(e["process_group"][0] == pg for e in d["entries"]))


def analyze(run_dir, unpickle) -> str:
    """Who is stuck where: every rank's last collective, group by group."""
    dumps, contexts = load_dumps(run_dir, unpickle)
    if not dumps:
        return f"no flight recorder dumps under {run_dir}/flight_recorder"
    lines = [f"flight recorder dumps from ranks {sorted(dumps)}"]
    for r, c in sorted(contexts.items()):
        reason = str(c.get("reason"))[:200]
        lines.append(f"  rank {r}: dumped at step {c.get('step')} ({c.get('phase')}): {reason}")
    pgs = sorted({e["process_group"][0] for d in dumps.values() for e in d["entries"] if not e["is_p2p"]})
    for pg in pgs:
        lines += _analyze_group(pg, _members(pg, dumps, contexts), dumps)
    return "\n".join(lines)


def _late(at_top: dict[int, dict]) -> tuple[int, dict[int, float]]:
    """(the first rank in the collective, {rank: seconds after it} for those that entered only
    once the first had waited its whole timeout there). Such a rank was stuck before the call
    and reached it after its peer gave up (a stall that ends before the launcher's SIGTERM
    does), so it counts as never having called it. Creation times are wall clock: across hosts
    NTP skew (ms) is far below a collective timeout."""
    times = {r: e.get("time_created_ns") for r, e in at_top.items()}
    first = min(times, key=lambda r: times[r] or 0)
    timeout_ms = at_top[first].get("timeout_ms")
    if not all(isinstance(t, int) for t in times.values()) or not isinstance(timeout_ms, (int, float)):
        return first, {}
    deadline = times[first] + timeout_ms * 1e6
    return first, {r: (t - times[first]) / 1e9 for r, t in times.items() if t > deadline > 0}


def _analyze_group(pg, members, dumps) -> list[str]:
    last = {}
    for r, d in dumps.items():
        mine = [e for e in d["entries"] if e["process_group"][0] == pg and not e["is_p2p"]]
        if mine:
            last[r] = mine[-1]
    top = max(e["collective_seq_id"] for e in last.values())
    first, late = _late({r: e for r, e in last.items() if e["collective_seq_id"] == top})
    waiting = sorted(r for r, e in last.items() if e["collective_seq_id"] == top and r not in late)
    behind = [r for r in members if r not in waiting]
    what = describe(last[first])
    lines = [f"group {members} (process group {pg}): furthest collective {what}"]
    if behind:
        tail = f" in time (ranks {sorted(late)} reached it after the others' timeout)" if late else ""
        lines.append(f"  ranks {waiting} are in {what}; ranks {behind} never called it{tail}")
    for r in members:
        e = last.get(r)
        if r not in dumps:
            lines.append(f"  rank {r}: no dump (killed, or never started?)")
        elif e is None:
            lines.append(f"  rank {r}: no collective in this group")
        elif r in late:
            lines.append(f"  rank {r}: reached {what} {late[r]:.1f} s after rank {first}, past its "
                         f"{last[first]['timeout_ms'] / 1e3:g} s timeout: stuck before it")
        elif e["collective_seq_id"] < top:
            lines.append(f"  rank {r}: last {describe(e)}: never called #{top}, "
                         f"which ranks {waiting} are waiting in")
        else:
            status = dumps[r].get("pg_status", {}).get(pg, {})
            done = status.get("last_completed_collective", top)
            state = " (not completed)" if isinstance(done, int) and 0 <= done < top else ""
            lines.append(f"  rank {r}: in {describe(e)}{state}")
    return lines
