"""The wrapper's gradient hooks and who owns a module: one live wrapper per module.

`GradHooks` holds the post-accumulate-grad hooks of one reducer: on every trained parameter
(each calls `autograd_hook(i, p)`), or, once the reducer knows the order gradients arrive in,
on one parameter per bucket, the one whose gradient arrives last (`bucket_hook(b, p)`). A
finalizer on the wrapper removes them when the wrapper is dropped (or `remove_hooks()`), and the
reducer goes with them. A module has one live wrapper, the newest (torch allows re-wrapping,
e.g. `ddp = DDP(model, **opts)` in a sweep): the previous one loses its hooks, which would fight
over .grad, and is retired (its forward raises `retired_error`).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

# module -> weakref to the live minddp wrapper that owns its hooks
OWNERS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


class GradHooks:
    """The hooks on a reducer's parameters: `set({i: fn})` hooks exactly those parameters (the
    previous hooks go), each calling fn(p) once its gradient was accumulated."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self._handles: list = []
        self.closed = False  # the wrapper let its module go: nothing is hooked again

    def set(self, fns: dict) -> None:
        self.remove()
        if not self.closed:
            self._handles = [self.params[i].register_post_accumulate_grad_hook(fn) for i, fn in fns.items()]

    def close(self) -> None:
        self.closed = True
        self.remove()

    @property
    def hooked(self) -> int:
        """How many parameters carry a hook now."""
        return len(self._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def attach(wrapper, module: nn.Module, reducer) -> weakref.finalize:
    """Hook the parameters to `reducer` and take the module over; returns the finalizer that
    removes the hooks (also when the wrapper is garbage-collected)."""
    reducer.hook_all()
    finalizer = weakref.finalize(wrapper, release, reducer.hooks, weakref.ref(module), weakref.ref(wrapper))
    take_over(module, wrapper)  # an older wrapper of this module is retired
    return finalizer


def per_parameter(reducer, n: int) -> dict:
    """Every parameter's hook calls the reducer's `autograd_hook(i, p)` directly."""
    return {i: functools.partial(reducer.autograd_hook, i) for i in range(n)}


def per_bucket(reducer, last: dict[int, int]) -> dict:
    """`last`: bucket -> its parameter whose gradient arrives last; that one calls `bucket_hook(b, p)`."""
    return {i: functools.partial(reducer.bucket_hook, b) for b, i in last.items()}


def take_over(module: nn.Module, new) -> None:
    """`new` becomes the module's live wrapper; the previous one is retired."""
    owner = OWNERS.get(module)
    old = owner() if owner is not None else None
    if old is not None and old is not new:
        old.retire()
    OWNERS[module] = weakref.ref(new)


def release(grad_hooks: GradHooks, module_ref, owner) -> None:
    """A wrapper's hooks go (remove_hooks(), or the wrapper was garbage-collected)."""
    grad_hooks.close()
    module = module_ref()
    if module is not None and OWNERS.get(module) is owner:
        OWNERS.pop(module, None)


def retired_error() -> None:
    raise RuntimeError(
        "minddp.DistributedDataParallel: this wrapper is retired: its module was wrapped again by a newer "
        "DistributedDataParallel, which took over the module's gradient hooks (one live wrapper per module). "
        "Use the new wrapper; to go back, wrap `old.module` again.")
