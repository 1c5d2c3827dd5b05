"""Pickling the wrapper as torch DDP does: `torch.save(ddp)`, `copy.deepcopy(ddp)` (EMA and
teacher copies).

What a process holds is dropped (the process group, the reduction and its worker thread, the
observer, the usage flags in flight, the gradient hooks, the bucket buffers, registered
callbacks); the options, the module and the bucket order travel. Unpickling rebuilds the engine
for the copy's own parameters, on the default process group (torch's rule: a wrapper on another
group refuses to pickle), without a collective. Like torch's, the copy is a wrapper that trains:
its forward broadcasts buffers and its backward reduces gradients, so every rank must make it.
"""

from __future__ import annotations

import torch.distributed as dist

# per-process state: the reducer (buckets, reduction, observer, flags, the iteration), the
# mixed-precision casts (they hold the parameters' full-precision data), the hooks
DROPPED = frozenset({"process_group", "reducer", "mixed", "uneven", "_finalizer", "params"})


def getstate(ddp) -> dict:
    if ddp.process_group != dist.group.WORLD:  # torch's error, word for word
        raise RuntimeError("DDP Pickling/Unpickling are only supported when using DDP with the default "
                           "process group. That is, when you have called init_process_group and have not "
                           "passed process_group argument to DDP constructor")
    state = {k: v for k, v in ddp.__dict__.items() if k not in DROPPED}
    state["_bucket_order"] = ddp.layout.order()
    state["_static_graph"] = ddp.static_graph
    return state


def restored(state: dict) -> tuple[dict, list[int], bool]:
    """(the wrapper's attributes on the default group, its parameters re-read from its module;
    the bucket order; static_graph): the wrapper rebuilds its reducer and hooks from these."""
    state = dict(state)
    order, static_graph = state.pop("_bucket_order"), state.pop("_static_graph")
    state["process_group"], state["uneven"] = dist.group.WORLD, None
    named = dict(state["_modules"]["module"].named_parameters())
    state["params"] = [named[n] for n in state["names"]]
    return state, order, static_graph
