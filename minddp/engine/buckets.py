"""Bucket assignment and flat gradient buffers: where every gradient lives.

Pure logic, no process groups: which parameters share a bucket (`assign_buckets`), and the
`Layout` that gives each bucket its flat buffer and each parameter its gradient's view into it.
A layout and its buckets are immutable descriptions: what changes during an iteration (pending
counts, futures, unused parameters) is the iteration's (minddp.engine.iteration); a rebuild makes
a new layout. The reducer (minddp.engine.reducer) launches one collective per bucket.

Rules (torch DDP's reducer, `compute_bucket_assignment_by_size`, so a cap copied
from a torch DDP config gives the same buckets):
- parameters are taken in the order given (the engine passes reverse
  registration order first, then the observed gradient-ready order);
- one dtype and one device per bucket;
- a bucket closes once it *reaches* its limit, so buckets are at least the cap
  (except the last of each dtype); `strict=True` instead never lets a bucket
  exceed the cap (a single larger tensor gets a bucket of its own);
- the limits are [first_cap, cap, cap, ...]: torch uses a 1 MiB first bucket
  only when no cap is given (`bucket_cap_mb=None`: 25 MiB after a 1 MiB
  first bucket); with an explicit cap every bucket, the first too, gets it;
  torch 2.13's `bucket_cap_mb_list` gives the list itself (the last repeats);
- buckets are ordered by the position of their first parameter, so bucket 0
  holds the gradients that become ready first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import grads
from .options import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB, MiB  # noqa: F401  (MiB: importers')


@dataclass(frozen=True)
class TensorSpec:
    """What bucketing needs to know about one parameter."""

    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(t.numel(), t.dtype, t.device)


def bucket_limits(cap_mb: float | None, first_cap_mb: float | None = None) -> tuple[int, int]:
    """(first bucket, later buckets) in bytes, as torch DDP derives them from bucket_cap_mb."""
    if cap_mb is not None and cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {cap_mb}")
    cap = int((DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb) * MiB)
    if first_cap_mb is None:
        first_cap_mb = FIRST_BUCKET_CAP_MB if cap_mb is None else cap / MiB
    return min(cap, int(first_cap_mb * MiB)), cap


def assign_buckets(
    specs: list[TensorSpec],
    order: list[int],
    cap_mb: float | None,
    first_cap_mb: float | None = None,
    strict: bool = False,
    caps_mb: list[float] | None = None,
) -> list[list[int]]:
    """Group tensor indices into buckets.

    `specs[i]` describes tensor i; `order` is the order in which tensors are
    expected to become ready (a permutation of a subset of indices).
    `caps_mb` (torch's `bucket_cap_mb_list`) gives each bucket of a dtype its own
    cap, the last one repeating; it replaces `cap_mb` and `first_cap_mb`.
    Returns a list of buckets, each a list of tensor indices in `order` order.
    """
    limits = [int(c * MiB) for c in caps_mb] if caps_mb else list(bucket_limits(cap_mb, first_cap_mb))
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_per_key: dict[tuple, int] = {}
    done: list[list[int]] = []

    def close(key):
        done.append(open_buckets.pop(key))
        open_bytes[key] = 0
        closed_per_key[key] = closed_per_key.get(key, 0) + 1

    for i in order:
        s = specs[i]
        key = (s.dtype, s.device)
        limit = limits[min(closed_per_key.get(key, 0), len(limits) - 1)]
        if strict and open_buckets.get(key) and open_bytes[key] + s.nbytes > limit:
            close(key)  # strict: close *before* the cap would be exceeded
            limit = limits[min(closed_per_key[key], len(limits) - 1)]
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + s.nbytes
        if not strict and open_bytes[key] >= limit:
            close(key)  # torch: close once the cap is reached
    done.extend(b for b in open_buckets.values() if b)

    position = {i: p for p, i in enumerate(order)}
    done.sort(key=lambda b: position[b[0]])
    return done


@dataclass(frozen=True, eq=False)
class Bucket:
    """One flat buffer and the parameters whose gradients are views into it.

    `buffer` is what autograd accumulates into and what travels; `grads` is where each `.grad`
    ends after the reduction: the same tensor, except under mixed precision (minddp.engine.
    mixed_precision), where the buffer holds the forward's dtype and `grads` the parameters' own."""

    index: int
    param_ids: tuple[int, ...]  # indices into the engine's parameter list
    offsets: tuple[int, ...]  # start of each parameter's slice in `buffer`
    numels: tuple[int, ...]
    buffer: torch.Tensor
    grads: torch.Tensor
    sparse: bool = False  # one parameter with a sparse gradient: reduced as it is, no flat buffer

    @functools.cached_property
    def grad_nbytes(self) -> int:
        return sum(self.numels) * self.buffer.element_size()

    @functools.cached_property
    def gradient_region(self) -> torch.Tensor:
        """The part of `buffer` the gradients fill (no padding, no usage flags)."""
        return self.buffer[: sum(self.numels)]

    def view(self, k: int, shape: torch.Size) -> torch.Tensor:
        """The slice of the buffer that is parameter k's gradient."""
        return self.buffer[self.offsets[k] : self.offsets[k] + self.numels[k]].view(shape)

    def grad_view(self, k: int, shape: torch.Size) -> torch.Tensor:
        """The slice of `grads` that is parameter k's `.grad` after the reduction."""
        return self.grads[self.offsets[k] : self.offsets[k] + self.numels[k]].view(shape)


def _make_bucket(params, b: int, ids: list[int], extra: int, pad_to: int, dtype) -> Bucket:
    """One zeroed flat buffer for parameters `ids`, `extra` elements after them (the last
    bucket's usage flags, minddp.engine.usage), its length padded to a multiple of `pad_to` (the
    world size, when buckets are reduce-scattered into equal shards), in `dtype` (None: the
    parameters' own; then `grads` is the buffer itself)."""
    offsets, numels, pos = [], [], 0
    for i in ids:
        offsets.append(pos)
        numels.append(params[i].numel())
        pos += params[i].numel()
    first = params[ids[0]]
    length = -(-(pos + extra) // pad_to) * pad_to
    grads = torch.zeros(length, dtype=first.dtype, device=first.device)
    buffer = grads if dtype in (None, first.dtype) else torch.zeros(length, dtype=dtype, device=first.device)
    return Bucket(b, tuple(ids), tuple(offsets), tuple(numels), buffer, grads)


@dataclass(frozen=True, eq=False)
class Layout:
    """Where every gradient lives: the engine's buckets, as a public map (ZeRO-1 reads it).

    `buckets[b].buffer` is bucket b's flat gradient buffer; parameter i's gradient is
    `views[i]`, element `offset_of(i)` onwards of bucket `bucket_of(i)`; its `.grad` after the
    reduction is `grad_views[i]` (the same view, but under mixed precision). Under sharding
    (`shards` > 1) every buffer is padded to a multiple of `shards` and `shard_range(b)` is this
    rank's [lo, hi) of bucket b. `version` grows by one at each rebuild; `flat_params`, under
    ZeRO-1, the flat buffers the parameters live in, laid out like the buckets (else None).
    `Layout.build` makes one; nothing changes it afterwards.
    """

    buckets: tuple[Bucket, ...]
    views: tuple[torch.Tensor | None, ...]  # None: a sparse gradient
    grad_views: tuple[torch.Tensor | None, ...]
    where: tuple[tuple[int, int] | None, ...]  # parameter i -> (bucket, position in it)
    flags_bucket: int | None  # the usage flags ride after this bucket's gradients
    shards: int = 1
    shard_index: int = 0
    version: int = 1
    flat_params: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def build(cls, params: list[torch.Tensor], assignment: list[list[int]], tail_numel: int = 0,
              shards: int = 1, shard_index: int = 0, version: int = 1, sparse: list[bool] | None = None,
              flat_params: bool = False, dtype: torch.dtype | None = None) -> "Layout":
        """Buffers for `assignment` (buckets of parameter indices), `tail_numel` usage flags after
        the last dense bucket, in `dtype` (mixed precision's; None: the parameters' own), and with
        `flat_params` the parameters moved into flat buffers laid out like the buckets (ZeRO-1).

        Each existing gradient moves into its new view, bucket by bucket: a previous layout's
        buffer is freed once its last gradient has moved (when nothing else holds it), so a
        rebuild never holds two full copies of the gradients."""
        sparse = sparse or [False] * len(params)
        views: list[torch.Tensor | None] = [None] * len(params)
        grad_views: list[torch.Tensor | None] = [None] * len(params)
        where: list[tuple[int, int] | None] = [None] * len(params)
        dense = [b for b, ids in enumerate(assignment) if not sparse[ids[0]]]
        flags_bucket = dense[-1] if dense else None
        buckets = []
        for b, ids in enumerate(assignment):
            if sparse[ids[0]]:
                where[ids[0]] = (b, 0)
                empty = torch.zeros(0, dtype=params[ids[0]].dtype)
                numel = (params[ids[0]].numel(),)
                buckets.append(Bucket(b, tuple(ids), (0,), numel, empty, empty, sparse=True))
                continue
            bucket = _make_bucket(params, b, ids, tail_numel if b == flags_bucket else 0, shards, dtype)
            for k, i in enumerate(ids):
                p = params[i]
                views[i], where[i] = bucket.view(k, p.shape), (b, k)
                grad_views[i] = views[i] if bucket.grads is bucket.buffer else bucket.grad_view(k, p.shape)
                grads.move_into(p, grad_views[i])  # (its old buffer may go once the last has moved)
            buckets.append(bucket)
        flats = tuple(flatten_params(params, buckets)) if flat_params else None
        return cls(tuple(buckets), tuple(views), tuple(grad_views), tuple(where), flags_bucket,
                   shards, shard_index, version, flats)

    def bucket_of(self, i: int) -> int:
        """The bucket holding parameter i's gradient."""
        return self.where[i][0]

    def offset_of(self, i: int) -> int:
        """Where parameter i's gradient starts in its bucket's buffer."""
        b, k = self.where[i]
        return self.buckets[b].offsets[k]

    def flags(self, n: int) -> torch.Tensor | None:
        """The n usage flags after the last dense bucket's gradients (minddp.engine.usage)."""
        return None if self.flags_bucket is None else self.buckets[self.flags_bucket].buffer[-n:]

    def shard_range(self, b: int) -> tuple[int, int]:
        """[lo, hi) of bucket b's buffer that this rank owns (the whole buffer unsharded)."""
        per = self.buckets[b].buffer.numel() // self.shards
        return self.shard_index * per, (self.shard_index + 1) * per

    def gradients(self) -> list[torch.Tensor]:
        """Each bucket's gradients as `.grad` holds them (without padding and flags): the whole
        averaged gradient, when unsharded."""
        if self.shards > 1:
            raise RuntimeError("with shard_optimizer each rank holds only its shard of the gradients: "
                               "use ShardedOptimizer.grad_norm() / clip_grad_norm_()")
        if any(b.sparse for b in self.buckets):
            raise RuntimeError("minddp: grad_norm()/clip_grad_norm_() read the flat buckets, and a sparse "
                               "gradient has none: use torch.nn.utils.clip_grad_norm_(model.parameters())")
        return [b.grads[: sum(b.numels)] for b in self.buckets]

    def order(self) -> list[int]:
        """Parameter indices in bucket order."""
        return [i for b in self.buckets for i in b.param_ids]


@torch.no_grad()
def flatten_params(params: list[torch.Tensor], buckets) -> list[torch.Tensor]:
    """Parameters become views of flat buffers laid out like the gradient buckets, one bucket
    at a time: a parameter's old storage goes as soon as nothing else holds it."""
    flats = []
    for bucket in buckets:
        flat = torch.zeros_like(bucket.buffer)
        for k, i in enumerate(bucket.param_ids):
            p = params[i]
            view = flat[bucket.offsets[k] : bucket.offsets[k] + bucket.numels[k]].view(p.shape)
            view.copy_(p)
            p.data = view
        flats.append(flat)
    return flats
