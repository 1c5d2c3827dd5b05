"""Fail together: one all_gather_object of each rank's outcome, so every rank raises at once.

A step that can fail on one rank only (its data file is broken, it reads another file, rank 0
cannot write the checkpoint) must not leave that rank exiting while the others wait in their
next collective (gloo's "remote worker crashing" ~30 s later, mixed exit codes). Every rank
calls `together` at the same point; if any failed, every rank raises, naming the failing rank.
The data check, the choice of a checkpoint to resume from and a checkpoint's write use it.
"""

from __future__ import annotations

import torch.distributed as dist

from ...errors import ConfigError


def together(error: BaseException | None, value=None, *, what: str | None = None,
             kinds: tuple[type, type] = (ConfigError, RuntimeError)) -> list:
    """Every rank's `value`, by rank, once no rank failed; else every rank raises. The first
    failing rank's error is reported, as `kinds[0]` if it was a ConfigError, else `kinds[1]`:
    - with `what` (the action: "resume", "save step 8"), a rank that failed raises its own
      error, the others "rank R could not <what>: <Kind>: <message>";
    - without, a ConfigError is the same line on every rank (exit 2 everywhere), naming the
      rank when not every rank failed alike; another error is the failing rank's own there and
      "<Kind>: <message>" on the others.
    Every rank must call it, at the same point."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return [value]
    world = dist.get_world_size()
    mine = None if error is None else (isinstance(error, ConfigError), f"{error}", type(error).__name__)
    gathered = [None] * world
    dist.all_gather_object(gathered, (mine, value))
    failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if not failed:
        return [v for _, v in gathered]
    rank, (config, text, kind) = failed[0]
    cls = kinds[0] if config else kinds[1]
    if what is not None:
        if error is not None:
            raise error
        raise cls(f"rank {rank} could not {what}: {kind}: {text}")
    if len(failed) < world or len({e[1] for _, e in failed}) > 1:
        text = f"on rank {rank} ({len(failed)} of {world} ranks failed): {text}"
    if config:
        raise cls(text) from None
    if error is not None:
        raise error
    raise cls(f"{kind}: {text}")
