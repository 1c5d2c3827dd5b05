"""Never hang silently, on torch's own machinery.

- Flight recorder: torch's native one. `configure()` (before the process group starts)
  sets `TORCH_FR_BUFFER_SIZE`, so every rank keeps its last N collectives on gloo and nccl
  alike (per-group sequence number, op, sizes, dtypes, creation time; on nccl also the
  state and timings, and a dump by the watchdog on timeout). `dump(run_dir, reason)` writes
  torch's dump to `<run_dir>/flight_recorder/rank<r>` (the format torch's own analyser,
  `python -m torch.distributed.flight_recorder.fr_trace`, reads) on any exception, on a
  collective timeout and on SIGTERM.
- minddp adds only what torch does not record (`<run_dir>/flight_recorder_context/rank<r>.json`):
  why the rank dumped (the exception or signal), where the trainer was (step and phase),
  and the ranks of each process group (gloo's dump has no group membership).
- Fingerprints: `TORCH_DISTRIBUTED_DEBUG=DETAIL` (`ddp.debug=true`, or `detail=True` here)
  wraps every process group so that ranks compare each collective (op, shapes, dtypes)
  before it runs; a mismatch raises on every rank naming both calls.

`python -m minddp.debug <run dir>` reads every rank's dump and says who is stuck where,
or who never called collective #N.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import safe_pickle

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}
_context: dict = {"step": None, "phase": None, "groups": {}}
_dumped = False  # the first dump of a process wins: later ones record the consequences


def configure(buffer_size: int = 2000, run_dir=None, detail: bool = False) -> None:
    """Call before init_process_group. Never overrides what the user exported."""
    if buffer_size > 0:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(buffer_size))
        if run_dir is not None:  # where nccl's watchdog writes its own dump on a timeout
            (Path(run_dir) / "flight_recorder").mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(run_dir) / "flight_recorder" / "rank"))
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if detail:
        enable_fingerprints()


def enable_fingerprints() -> None:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL for process groups created from now on."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level(dist.DebugLevel.DETAIL)


def env_detail() -> bool:
    """Fingerprints asked for from the environment (MINDDP_DEBUG=1 or torch's own variable)."""
    return os.environ.get("MINDDP_DEBUG") == "1" or os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL"


def recording() -> bool:
    return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) > 0


def set_context(**kw) -> None:
    """Where the trainer is (step, phase): a dict update, free enough for every step."""
    _context.update(kw)


def register_groups(*groups) -> None:
    """Remember the ranks of these process groups (torch's gloo dump has none)."""
    for g in groups:
        g = g or dist.group.WORLD
        _context["groups"][g.group_name] = dist.get_process_group_ranks(g)


def dump(run_dir, reason: str = "") -> Path | None:
    """Write torch's flight recorder and minddp's context for this rank; None if not recording.

    The first dump of a process is kept: it shows the state when the problem was seen
    (later errors are usually its consequences, and only add their reason to the context)."""
    global _dumped
    if not recording() or not dist.is_initialized():
        return None
    rank = dist.get_rank()
    path = Path(run_dir) / "flight_recorder" / f"rank{rank}"
    context_path = Path(run_dir) / "flight_recorder_context" / f"rank{rank}.json"
    if _dumped:
        context = json.loads(context_path.read_text())
        context.setdefault("later", []).append(reason)
    else:
        _atomic_write(path, torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False))
        context = {"rank": rank, "world_size": dist.get_world_size(), "reason": reason,
                   "time": time.time(), **_context}
        _dumped = True
    _atomic_write(context_path, json.dumps(context, indent=1).encode())
    return path


def _atomic_write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------ analysis
def load_dumps(run_dir) -> tuple[dict[int, dict], dict[int, dict]]:
    """({rank: torch's dump}, {rank: minddp's context}) from a run directory."""
    dumps, contexts = {}, {}
    for p in sorted((Path(run_dir) / "flight_recorder").glob("rank*")):
        if p.name[4:].isdigit():
            dumps[int(p.name[4:])] = safe_pickle.load(p)
    for p in sorted((Path(run_dir) / "flight_recorder_context").glob("rank*.json")):
        c = json.loads(p.read_text())
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
        world = max([c["world_size"] for c in contexts.values()] + [max(dumps) + 1])
        return list(range(world))
    return sorted(r for r, d in dumps.items() if any(e["process_group"][0] == pg for e in d["entries"]))


def analyze(run_dir) -> str:
    """Who is stuck where: every rank's last collective, group by group."""
    dumps, contexts = load_dumps(run_dir)
    if not dumps:
        return f"no flight recorder dumps under {run_dir}/flight_recorder"
    lines = [f"flight recorder dumps from ranks {sorted(dumps)}"]
    for r, c in sorted(contexts.items()):
        lines.append(f"  rank {r}: dumped at step {c.get('step')} ({c.get('phase')}): {c['reason'][:200]}")
    pgs = sorted({e["process_group"][0] for d in dumps.values() for e in d["entries"] if not e["is_p2p"]})
    for pg in pgs:
        lines += _analyze_group(pg, _members(pg, dumps, contexts), dumps)
    return "\n".join(lines)


def _analyze_group(pg, members, dumps) -> list[str]:
    last = {}
    for r, d in dumps.items():
        mine = [e for e in d["entries"] if e["process_group"][0] == pg and not e["is_p2p"]]
        if mine:
            last[r] = mine[-1]
    top = max(e["collective_seq_id"] for e in last.values())
    waiting = sorted(r for r, e in last.items() if e["collective_seq_id"] == top)
    behind = [r for r in members if r not in waiting]
    lines = [f"group {members} (process group {pg}): furthest collective {describe(last[waiting[0]])}"]
    if behind:
        lines.append(f"  ranks {waiting} are in {describe(last[waiting[0]])}; "
                     f"ranks {behind} never called it")
    for r in members:
        e = last.get(r)
        if r not in dumps:
            lines.append(f"  rank {r}: no dump (killed, or never started?)")
        elif e is None:
            lines.append(f"  rank {r}: no collective in this group")
        elif e["collective_seq_id"] < top:
            lines.append(f"  rank {r}: last {describe(e)}: never called #{top}, "
                         f"which ranks {waiting} are waiting in")
        else:
            status = dumps[r].get("pg_status", {}).get(pg, {})
            done = status.get("last_completed_collective", top)
            state = " (not completed)" if isinstance(done, int) and 0 <= done < top else ""
            lines.append(f"  rank {r}: in {describe(e)}{state}")
    return lines


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m minddp.debug <run dir>\n\n" + __doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    print(analyze(argv[0]))


if __name__ == "__main__":
    main()
