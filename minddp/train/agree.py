"""Decisions every rank makes together: one all_gather_object of each rank's outcome.

A step that can fail on one rank only (its data file is broken, it reads another file) must
not leave that rank exiting while the others wait in their next collective (gloo's "remote
worker crashing" ~30 s later, mixed exit codes). Every rank calls `together` at the same
point; if any failed, every rank raises the same one-line error.
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import ConfigError


def together(error: BaseException | None, value=None) -> list:
    """Every rank's `value`, by rank, once no rank failed; else the first failure on every rank
    (a ConfigError stays one: exit 2 everywhere). Every rank must call it."""
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
    if len(failed) < world or len({e[1] for _, e in failed}) > 1:
        text = f"on rank {rank} ({len(failed)} of {world} ranks failed): {text}"
    if config:
        raise ConfigError(text) from None
    if error is not None:
        raise error
    raise RuntimeError(f"{kind}: {text}")
