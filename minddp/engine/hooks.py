"""The wrapper's gradient hooks and who owns a module: one live wrapper per module.

Each trained parameter gets a post-accumulate-grad hook that calls its reducer's
`autograd_hook(i, p)`; a finalizer on the wrapper removes the hooks when the wrapper is dropped
(or `remove_hooks()`), and the reducer goes with them. A module has one live wrapper, the newest
(torch allows re-wrapping, e.g. `ddp = DDP(model, **opts)` in a sweep): the previous one loses
its hooks, which would fight over .grad, and is retired (its forward raises `retired_error`).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

# module -> weakref to the live minddp wrapper that owns its hooks
OWNERS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def attach(wrapper, module: nn.Module, params: list[torch.Tensor], reducer) -> tuple[list, weakref.finalize]:
    """Hook every parameter to `reducer` and take the module over; returns (the hook handles, the
    finalizer that removes them, also when the wrapper is garbage-collected)."""
    # each hook calls the reducer directly (one call per gradient); the wrapper's finalizer removes
    # them, so a dropped wrapper's reducer goes with its hooks
    handles = [p.register_post_accumulate_grad_hook(functools.partial(reducer.autograd_hook, i))
               for i, p in enumerate(params)]
    finalizer = weakref.finalize(wrapper, release, handles, weakref.ref(module), weakref.ref(wrapper))
    take_over(module, wrapper)  # an older wrapper of this module is retired
    return handles, finalizer


def take_over(module: nn.Module, new) -> None:
    """`new` becomes the module's live wrapper; the previous one is retired."""
    owner = OWNERS.get(module)
    old = owner() if owner is not None else None
    if old is not None and old is not new:
        old.retire()
    OWNERS[module] = weakref.ref(new)


def release(handles, module_ref, owner) -> None:
    """A wrapper's hooks go (remove_hooks(), or the wrapper was garbage-collected)."""
    for h in handles:
        h.remove()
    module = module_ref()
    if module is not None and OWNERS.get(module) is owner:
        OWNERS.pop(module, None)


def retired_error() -> None:
    raise RuntimeError(
        "minddp.DistributedDataParallel: this wrapper is retired: its module was wrapped again by a newer "
        "DistributedDataParallel, which took over the module's gradient hooks (one live wrapper per module). "
        "Use the new wrapper; to go back, wrap `old.module` again.")
