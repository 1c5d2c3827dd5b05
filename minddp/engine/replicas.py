"""Which tensors travel to keep the replicas equal: the init sync and each forward's buffers.

torch's rules: at construction every parameter and buffer goes from the group's first rank to
the others (`_sync_module_states`), buffers left out after the deprecated
`broadcast_buffers=False`; before each forward the buffers go again, re-read from
`module.named_buffers()` each time, since a module may reassign one (pytorch#63916). Names given
to `_set_params_and_buffers_to_ignore_for_model` never travel.

A forward's broadcast writes through `.data` (an alias with its own version counter), as torch's
broadcast_coalesced does not bump autograd's version counter (its NOTE [Version Counter in
comm.*_coalesced]): two forwards before one backward (BatchNorm) must not see a buffer the first
forward saved for backward marked as modified in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import broadcast_coalesced


def named_synced_buffers(module: nn.Module, ignored) -> dict[str, torch.Tensor]:
    """The buffers that travel, by name (torch's named_module_buffers), re-read each time."""
    return {n: b for n, b in module.named_buffers() if n not in ignored}


def broadcast_buffers(buffers: list[torch.Tensor], group, src: int) -> None:
    """Each forward's buffer sync, from global rank `src`, invisible to autograd's version check."""
    broadcast_coalesced([b.data for b in buffers], group, src)


def init_sync(ddp, module: nn.Module, buffers: bool) -> None:
    """Every rank starts from the first rank's parameters (and buffers). Flat parameter buffers
    (ZeRO-1's) travel as they are, the rest in coalesced chunks."""
    flat, rest = ddp.reduction.replicas(module, ddp.parameters_to_ignore)  # ignored ones never touched
    for t in flat:
        dist.broadcast(t, src=ddp.src_rank, group=ddp.process_group)
    buffers = list(named_synced_buffers(module, ddp.parameters_to_ignore).values()) if buffers else []
    broadcast_coalesced(rest + buffers, ddp.process_group, ddp.src_rank)
