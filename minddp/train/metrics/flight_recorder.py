"""Never hang silently, on torch's own machinery.

- Flight recorder: torch's native one. `configure()` (before the process group starts)
  sets `TORCH_FR_BUFFER_SIZE`, so every rank keeps its last N collectives on gloo and nccl
  alike (per-group sequence number, op, sizes, dtypes, creation time; on nccl also the
  state and timings, and a dump by the watchdog on timeout). `dump(run_dir, reason)` writes
  torch's dump to `<run_dir>/flight_recorder/rank<r>` (the format torch's own analyser,
  `python -m torch.distributed.flight_recorder.fr_trace`, reads) on any exception, on a
  collective timeout and on SIGTERM: NCCL's own recorder on nccl, gloo's on gloo. On a
  timeout nccl's watchdog also writes `watchdog_rank<r>` there.
- minddp adds only what torch does not record (`<run_dir>/flight_recorder_context/rank<r>.json`):
  why the rank dumped (the exception or signal), where the trainer was (step and phase),
  and the ranks of each process group (gloo's dump has no group membership).
- Fingerprints: `TORCH_DISTRIBUTED_DEBUG=DETAIL` (`ddp.debug=true`, or `detail=True` here)
  wraps every process group so that ranks compare each collective (op, shapes, dtypes)
  before it runs; a mismatch raises on every rank naming both calls.

`minddp debug <run dir>` (minddp/tools/debug.py) reads every rank's dump and says who is
stuck where, or who never called collective #N.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from ... import _compat
from ...io.atomic import atomic_write

WATCHDOG_PREFIX = "watchdog_rank"  # nccl's watchdog dump: <run_dir>/flight_recorder/watchdog_rank<r>
# where the trainer is (step, phase) and the ranks of each group, written into every dump; the
# step's probe updates it in place (a dict update per step, no call here)
CONTEXT: dict = {"step": None, "phase": None, "groups": {}}
_dumped = False  # the first dump of a process wins: later ones record the consequences


def configure(buffer_size: int = 2000, run_dir=None, detail: bool = False) -> None:
    """Call before init_process_group. Never overrides what the user exported."""
    if buffer_size > 0:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(buffer_size))
        if run_dir is not None:  # where nccl's watchdog writes its own dump on a timeout: a name
            # of its own (watchdog_rank<r>), or its file and minddp's rank<r> would overwrite each other
            (Path(run_dir) / "flight_recorder").mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE",
                                  str(Path(run_dir) / "flight_recorder" / WATCHDOG_PREFIX))
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
    CONTEXT.update(kw)


def register_groups(*groups) -> None:
    """Remember the ranks of these process groups (torch's gloo dump has none)."""
    for g in groups:
        g = g or dist.group.WORLD
        CONTEXT["groups"][g.group_name] = dist.get_process_group_ranks(g)


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
        atomic_write(path, _compat.dump_flight_recorder(str(dist.get_backend())))
        context = {"rank": rank, "world_size": dist.get_world_size(), "reason": reason,
                   "time": time.time(), **CONTEXT}
        _dumped = True
    atomic_write(context_path, json.dumps(context, indent=1).encode())
    return path
