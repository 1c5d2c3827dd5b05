"""Where `.grad` is written: the engine's only assignments to a parameter's `.grad`.

minddp's gradients live in the buckets' flat buffers: after a synchronised backward every `.grad`
is a view of its bucket (as torch DDP's with `gradient_as_bucket_view=True`), holding the
average. A gradient reaches its view in one of two ways:
- accumulated in place: `.grad` already was the view (`zero_grad(set_to_none=False)`), autograd
  added into it: nothing to do; on the CPU a `.grad` that is None is pointed at its zeroed view
  when the forward ends (`point_at_views`; `unpoint` puts back None where no gradient came), so
  the default loop takes this way too;
- fresh: `.grad` was None at the backward (`zero_grad()`'s default, on CUDA; or set to None after
  the forward; or a no_sync() micro-step's local gradient), so autograd made a tensor of its own; the
  bucket's fresh gradients are copied in with one `torch._foreach_copy_` when the bucket goes
  out (`land`), and `.grad` points at the view from then on (the fresh tensors go per bucket).
The average's 1/n is not applied here: the whole bucket is scaled in one pass before its sum
(minddp.engine.communicator.Communicator.pre_divide; one `torch._foreach_copy_` and one scaling
pass per bucket cost the host less than torch's per-gradient `mul_out` calls).

The rarer writes are here too: a gradient autograd left undefined (zeros, torch's), an unused
parameter's contribution and the `.grad` it is left with, the moves into new buffers (a rebuild,
mixed precision's param_dtype buckets), the full-precision result of mixed precision, and a
sparse gradient's reduced value.
"""

from __future__ import annotations

import itertools
import operator

import torch

from .. import _compat

_GRAD = operator.attrgetter("grad")


def point_at_views(groups) -> list[int]:
    """Before a synchronised backward every dense `.grad` becomes its bucket view, so autograd
    accumulates straight into the bucket: one that is None is pointed at its zeroed view (a
    bucket whose every `.grad` is None is zeroed in one call), one held apart (no_sync()'s local
    gradients) is moved in. `groups`: per dense bucket (bucket, its parameters, their views).
    Returns the parameters that were None."""
    pointed = []
    for bucket, ps, vs in groups:
        held = list(map(_GRAD, ps))
        if all(map(operator.is_, held, vs)):  # kept: autograd adds into the views already
            continue
        if all(map(operator.is_, held, itertools.repeat(None))):  # zero_grad()'s default
            bucket.gradient_region.zero_()
            list(map(setattr, ps, itertools.repeat("grad"), vs))
            pointed += bucket.param_ids
            continue
        pointed += _move_in(bucket, ps, held, vs)
    return pointed


@torch.no_grad()  # (a gradient of create_graph=True carries a graph: the copy must not join it)
def _move_in(bucket, ps, held, vs) -> list[int]:
    """A bucket of mixed `.grad`s: None ones pointed at zeroed views, held ones copied into theirs."""
    none = [k for k, g in enumerate(held) if g is None]
    if none:
        _compat.foreach_zero_([vs[k] for k in none])
    for p, g, view in zip(ps, held, vs):
        if g is not view:
            if g is not None:
                view.copy_(g)
            p.grad = view
    return [bucket.param_ids[k] for k in none]


def unpoint(params: list[torch.Tensor], ids: list[int]) -> None:
    """Pointed parameters that got no gradient in the backward: `.grad` None again, as torch
    leaves it (a backward that reached none of them: functional_call, autograd.grad)."""
    for i in ids:
        params[i].grad = None


@torch.no_grad()
def land(params: list[torch.Tensor], ids: list[int], views) -> None:
    """The fresh gradients of parameters `ids` into their views, in one call; `.grad` = view."""
    dst, src = [], []
    for i in ids:
        p, view = params[i], views[i]
        dst.append(view)
        src.append(p.grad)
        p.grad = view
    _compat.foreach_copy_(dst, src)


def move_into(p: torch.Tensor, view: torch.Tensor) -> None:
    """A held `.grad` moves into `view` (a new layout, or a bucket of another dtype)."""
    grad = p.grad
    if grad is not None and grad is not view:
        view.copy_(grad)
        p.grad = view


def zero_undefined(p: torch.Tensor, view: torch.Tensor) -> None:
    """A hook saw `.grad` None (an autograd.Function returned None for it): torch's reducer
    reduces zeros in its place, and `.grad` is that average."""
    view.zero_()
    p.grad = view


def contribute_unused(p: torch.Tensor, view: torch.Tensor) -> bool:
    """An unused parameter's contribution to its bucket: what its `.grad` holds, or zeros.
    Returns whether `.grad` was None (what `restore_unused` leaves it)."""
    grad = p.grad
    if grad is None:
        view.zero_()
        return True
    if grad is not view and grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
        p.grad = view
    return False


def restore_unused(flags: list, unused: list[list], grad_views, params) -> None:
    """After the reduction, `.grad` of each unused parameter as torch DDP leaves it with
    gradient_as_bucket_view=True: the averaged view if some rank used it; if no rank did, None
    when it was None, else the view (the average of what the ranks held)."""
    for per_bucket in unused:
        for i, grad_was_none in per_bucket:
            if flags[i] != 0:
                params[i].grad = grad_views[i]
            elif grad_was_none:
                params[i].grad = None


def to_grad_views(params: list[torch.Tensor], grad_views) -> None:
    """Mixed precision, after the wait: each held `.grad` is its full-precision reduced view."""
    for p, view in zip(params, grad_views):
        if p.grad is not None:
            p.grad = view


def set_sparse(p: torch.Tensor, reduced: torch.Tensor) -> None:
    """A sparse gradient is its own bucket: `.grad` is the reduced tensor itself."""
    p.grad = reduced
