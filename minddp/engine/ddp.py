"""minddp.DistributedDataParallel: torch DDP's reducer, in Python.

One iteration, read top to bottom in this file (a forward outside `no_sync()`, then
`loss.backward()`):

1. `forward`: broadcast buffers (re-read: one may have been reassigned) from the group's first
   rank (if asked: torch's `require_forward_param_sync` rule), reset the per-iteration state
   (`_prepare_for_backward`), run the module. A forward that will not be followed by a
   synchronised backward (under `torch.no_grad()`/`inference_mode()`, or with
   `require_backward_grad_sync=False`) leaves a pending backward alone, as torch's does.
2. backward: autograd accumulates each gradient straight into its bucket's flat buffer
   (`param.grad` is a view of it, `layout.views[i]`). A post-accumulate hook
   (`_on_grad_ready`) marks the parameter ready; once bucket i and every bucket before it
   are complete, `_launch` starts bucket i's reduction asynchronously, so communication
   overlaps the rest of backward. Buckets go out strictly in index order on every rank,
   whatever order autograd delivers gradients in.
3. end of backward: `_finish_backward`, queued on the autograd engine by the first hook,
   launches what is left (buckets with unused parameters, or everything when
   overlap=False), waits for every bucket in order, and copies the usage flags carried by
   the last bucket to the host without waiting; a later forward reads them once landed and
   raises on every rank if some rank left a parameter unused (minddp.engine.usage; torch DDP raises
   there too). After the first iteration the buckets are rebuilt once in the observed
   gradient-ready order (rank 0's, broadcast: `rebuild`). `on_reduced(fn)` callbacks run
   with b right after bucket b's wait, later buckets still in flight (minddp.optim.overlap steps
   bucket b there); `on_rebuild(fn)` ones with the old layout before a rebuild drops it.

When `loss.backward()` returns, every `param.grad` holds the average over ranks.

Everything else sits beside the engine behind a small seam, so this file is only the above:
- how a bucket is reduced is a strategy object, `self.reduction` (minddp.engine.reductions:
  all-reduce, 16-bit compressed all-reduce, a comm hook, ZeRO-1's reduce-scatter); the
  algorithm (native, ring, tree, ...) is its reducer's;
- what is recorded (CommStats, host or CUDA-event timing, `trace`, profiler ranges) is the
  observer's (minddp.engine.observer), called at launch, done and wait;
- uneven inputs are minddp.engine.join's (`self.uneven` inside `join()`); usage flags minddp.engine.usage's;
- where every gradient lives is `self.layout` (minddp.engine.buckets.Layout), the public map
  ZeRO-1 (minddp.optim.zero) reads; gradient norms are minddp.parallel.gradnorm's.

The constructor's arguments (torch DDP's, in torch's order, then minddp's own) and what a script
reads or sets beside the step (torch's attributes, pickling, comm_stats, ...): minddp.engine.ddp_api.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .. import _compat
from ..comm.collectives import broadcast_coalesced
from . import checks, replicas
from . import join as _join
from .buckets import Layout, TensorSpec, assign_buckets
from .comm_hooks import BucketReducer
from .ddp_api import PublicAPI
from .observer import observer_for
from .reductions import make_reduction
from .usage import UsageFlags


class DistributedDataParallel(PublicAPI, nn.Module):
    """Data-parallel wrapper: same API shape as `torch.nn.parallel.DistributedDataParallel`."""

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,  # torch DDP's arguments, in its order, so its call sites work unchanged
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,  # deprecated in torch 2.13: forward_sync_buffers
        init_sync: bool = True,
        process_group=None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        overlap: bool = True,
        reduce_op: str = "avg",
        compress: str | None = None,
        algorithm: str = "native",
        ranks_per_node: int | None = None,
        strict_bucket_cap: bool = False,
        shard_optimizer: bool = False,
        optimizer_overlap: bool = False,
    ):
        super().__init__()
        compress = checks.normalise_compress(compress)
        checks.check_arguments(reduce_op, compress, bucket_cap_mb, shard_optimizer, algorithm,
                               find_unused_parameters, optimizer_overlap, bucket_cap_mb_list)
        process_group = checks.torch_arguments(module, device_ids, process_group, device_mesh,
                                               mixed_precision, delay_all_reduce_named_params,
                                               param_to_hook_all_reduce)
        checks.check_not_wrapped(module, DistributedDataParallel)
        self.forward_sync_buffers, init_sync_buffers = checks.buffer_sync(
            broadcast_buffers, forward_sync_buffers, check_reduction)  # torch 2.13's rule and warnings
        self.module = module
        self.process_group, self.device_mesh = process_group, device_mesh  # torch DDP's attributes
        self.bucket_cap_mb, self.strict_bucket_cap = bucket_cap_mb, strict_bucket_cap
        self.bucket_cap_mb_list = bucket_cap_mb_list  # torch 2.13: a cap per bucket (the last repeats)
        self.shard_optimizer, self.overlap, self.reduce_op = shard_optimizer, overlap, reduce_op
        self.optimizer_overlap = optimizer_overlap  # each bucket stepped once reduced: minddp.optim.overlap
        self.find_unused_parameters = find_unused_parameters
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params and find_unused_parameters
        self.batched_grad_copy = batched_grad_copy  # accepted: each gradient is one copy already
        self._engine_options = reduce_op, compress, algorithm, ranks_per_node  # kept by pickling
        self._replicate(module)
        self.rebuilt = False  # the buckets are rebuilt once, after the first iteration
        self._build_engine(list(reversed(range(len(self.params)))))
        if init_sync:  # torch's init_sync=False: the caller guarantees equal replicas
            replicas.init_sync(self, module, init_sync_buffers)
        self._attach_hooks(module)
        self.require_backward_grad_sync = True  # False inside no_sync(); torch DDP's attribute
        self.require_forward_param_sync = True  # torch DDP's rule for buffer broadcast

    def _replicate(self, module: nn.Module) -> None:
        """The trainable parameters in the engine's indexing; the same model on every rank."""
        self._ignored = checks.ignored_names(module)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in self._ignored]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        checks.check_trainable(self.names)
        self._group_info()
        checks.check_same_model(module, self.names, self.process_group, self._ignored)

    def _group_info(self) -> None:
        self.world_size = dist.get_world_size(self.process_group)
        self.src_rank = dist.get_process_group_ranks(self.process_group)[0]  # global (broadcast's src)
        self._specs = [TensorSpec.of(p) for p in self.params]
        self.device = self.params[0].device

    def _build_engine(self, order: list[int]) -> None:
        """What the constructor (and unpickling) builds from the options: reduction, observer,
        usage flags, the buckets in `order`; no collective."""
        reduce_op, compress, algorithm, ranks_per_node = self._engine_options
        reducer = BucketReducer(self.process_group, reduce_op, algorithm, ranks_per_node)
        self.reduction = make_reduction(reducer, compress, self.shard_optimizer, self.params)
        self.observer = observer_for(self.device, self.overlap)
        self.usage = UsageFlags(self.names, self.find_unused_parameters)
        self._reduced_callbacks, self._rebuild_callbacks = [], []  # on_reduced(fn), on_rebuild(fn)
        self.layout: Layout | None = None
        self._build_layout(order)
        self.uneven: _join.Join | None = None  # inside join()
        self._retired = False  # a newer wrapper took the module over (checks.take_over)
        self._expect_sync = self._reduced_since_forward = self._callback_queued = False  # see forward

    def _attach_hooks(self, module: nn.Module) -> None:
        # hooks hold a weak reference: a dropped wrapper removes its hooks (finalizer)
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, me, i))
                       for i, p in enumerate(self.params)]
        self._finalizer = weakref.finalize(self, checks.release, self._hooks, weakref.ref(module), me)
        checks.take_over(module, self)  # an older wrapper of this module is retired

    @property
    def module_buffers(self) -> list[torch.Tensor]:
        """The buffers each forward broadcasts, re-read each time (minddp.engine.replicas)."""
        return replicas.synced_buffers(self.module, self._ignored)

    def _build_layout(self, order: list[int]) -> None:
        """(Re)allocate the flat buffers for `order`; existing gradients move into them."""
        assignment = assign_buckets(self._specs, order, self.bucket_cap_mb, strict=self.strict_bucket_cap,
                                    caps_mb=self.bucket_cap_mb_list)
        version = self.layout.version + 1 if self.layout is not None else 1
        for fn in self._rebuild_callbacks:  # e.g. a sharded optimizer drops its views of the old buffers
            fn(self.layout)
        self.layout = None
        self.reduction.bind(None)  # let each old buffer go once its last gradient has moved
        shards = self.reduction.pad_to
        me = dist.get_group_rank(self.process_group, dist.get_rank()) if shards > 1 else 0
        self.layout = Layout(self.params, assignment, tail_numel=len(self.params), shards=shards,
                             shard_index=me, version=version)
        self.reduction.bind(self.layout)
        self.observer.layout_changed(len(self.layout.buckets))

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        if self._retired:
            checks.retired_error()
        self.usage.check()  # the last backwards' usage flags, once landed (minddp.engine.usage)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        bcast = self.require_forward_param_sync and self.forward_sync_buffers and self.world_size > 1
        src = self.src_rank
        if self.uneven is not None:  # tell the ranks that ran out of data what this iteration does
            src = self.uneven.on_forward(sync, bcast)
        if bcast:
            broadcast_coalesced(self.module_buffers, self.process_group, src)
        self.require_forward_param_sync = sync
        if torch.is_grad_enabled():  # a new graph: its backward may run (again) once
            self._reduced_since_forward = False
        if sync:
            self._prepare_for_backward()
        # otherwise a pending backward (forward, no-grad forward, backward) is left alone
        return self.module(*args, **kwargs)

    def _prepare_for_backward(self) -> None:
        self._expect_sync = True
        self._callback_queued = False
        self._ready = [False] * len(self.params)
        self._ready_order = []
        self._next_bucket = 0
        for b in self.layout.buckets:
            b.pending, b.future, b.unused = len(b.param_ids), None, []
        self.observer.start(len(self.layout.buckets))

    # ------------------------------------------------------------------ backward
    def _on_grad_ready(self, i: int, p: torch.Tensor) -> None:
        view, grad = self.layout.views[i], p.grad
        if grad is not view and (grad is None or grad.data_ptr() != view.data_ptr()):
            if grad is None:  # undefined (a backward returned None): zeros, as torch's reducer
                _undefined_grad(self, p, view)
            else:
                # .grad was None (e.g. after zero_grad(set_to_none=True)), so autograd
                # allocated a fresh tensor: move it into the bucket.
                if grad.is_sparse:
                    raise RuntimeError(
                        f"minddp: parameter {self.names[i]!r} has a sparse gradient (e.g. "
                        "nn.Embedding(sparse=True)); minddp reduces dense buckets only: use sparse=False")
                self.reduction.copy_in(i, view, grad, self._expect_sync)  # with the average's 1/n fused
                p.grad = view
        if not self._expect_sync:
            if self._reduced_since_forward:
                raise RuntimeError(
                    "minddp: backward ran again after this forward's gradients were already "
                    "reduced; run a forward before each backward, or accumulate under no_sync()")
            if grad is not None and self.find_unused_parameters:  # used in a no_sync() micro-step
                self.usage.used_unsynced[i] = True
            return
        if not self._callback_queued:
            self._callback_queued = True
            _compat.queue_autograd_callback(self._finish_backward)
        if self._ready[i]:
            raise RuntimeError(
                f"minddp: parameter {self.names[i]!r} received a gradient twice in one "
                "iteration. Call backward once per forward, or accumulate under no_sync().")
        self._ready[i] = grad is not None or not self.find_unused_parameters  # undefined: not a use
        self._ready_order.append(i)
        buckets = self.layout.buckets
        bucket = buckets[self.layout.bucket_of(i)]
        bucket.pending -= 1
        # Strictly in index order: bucket i never goes out before bucket i-1.
        while self.overlap and self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1
        self.observer.poll()

    def _launch(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        for i in bucket.param_ids:
            if not self._ready[i]:  # unused this iteration: contribute what .grad holds, or zeros
                p, view = self.params[i], self.layout.views[i]
                bucket.unused.append((i, p.grad is None))
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
        flags = bucket.buffer[-len(self.params):] if b == len(self.layout.buckets) - 1 else None
        if flags is not None:
            self.usage.write(flags, self._ready)  # minddp.engine.usage
        self.observer.launch(b, bucket.grad_nbytes, self.reduction.kind)
        if self.skip_all_reduce_unused_params and self.usage.unused_here(bucket):  # the flags only
            future = _Skipped(self.reduction.reducer(flags) if flags is not None else None)
        else:
            future = self.reduction.launch(b)
        bucket.future = self.observer.launched(b, future, self.reduction.take_work())

    def _finish_backward(self) -> None:
        """Runs once at the end of a synchronised backward (queued on the autograd engine)."""
        self._reduced_since_forward = True
        self._expect_sync = False
        self._reduce_rest_and_wait()
        self.usage.reduced(self.reduction.usage_flags(len(self.params)), self._ready, self.layout,
                           self.params)
        if not self.rebuilt:  # after the wait's locals are gone, so the old buffers can go
            self.rebuild(self._ready_order)

    def _reduce_rest_and_wait(self) -> None:
        """Launch the buckets not yet launched, then wait for every bucket in order."""
        buckets = self.layout.buckets
        self.observer.backward_end(self._next_bucket)
        for b in range(self._next_bucket, len(buckets)):
            self._launch(b)
        self._next_bucket = len(buckets)
        scale = self.uneven.grad_scale() if self.uneven is not None else None
        wire_bytes = 0
        for b, bucket in enumerate(buckets):  # in order; each result lands in its buffer
            result = bucket.future.wait()
            self.observer.done(b)
            bucket.future = None  # nothing outlives the step (a Work holds its tensors)
            if result is _Skipped:  # skip_all_reduce_unused_params: the gradients stayed home
                continue
            wire_bytes += self.reduction.finish(b, result)
            if scale is not None:  # averaged over the ranks still training, not the initial world
                bucket.buffer.mul_(scale)
            for fn in self._reduced_callbacks:  # e.g. step this bucket's parameters now
                fn(b)
        self.observer.wait_end(wire_bytes)

    def rebuild(self, ready_order: list[int]) -> None:
        """Once: re-bucket by rank 0's observed gradient-ready order (broadcast: a collective)."""
        self.rebuilt = True
        seen = set(ready_order)
        order = list(ready_order) + [i for i in reversed(range(len(self.params))) if i not in seen]
        device = self.layout.buckets[0].buffer.device if self.layout.buckets else self.device
        plan = torch.tensor(order, dtype=torch.int64, device=device)
        dist.broadcast(plan, src=self.src_rank, group=self.process_group)
        order = plan.tolist()
        if order != self.layout.order():
            self._build_layout(order)

    # --------------------------------------------------------------- public API
    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; wrap the forward *and* the backward.

        The next synchronised backward reduces the accumulated sum, which gives
        exactly the gradient of the combined batch.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Uneven inputs (torch's `Join`, torch's arguments): wrap the training loop; a rank that
        runs out of data shadows the others' collectives until every rank is done (minddp.engine.join).
        Gradients are averaged over the initial world size, or over the ranks still training."""
        return _join.join(self, enable=enable, throw_on_early_termination=throw_on_early_termination,
                          divide_by_initial_world_size=divide_by_initial_world_size)

    def register_comm_hook(self, state, hook) -> None:
        """Replace how buckets are reduced: `hook(state, GradBucket) -> Future`."""
        checks.check_comm_hook(hook)  # torch's checks, at registration
        self.reduction = self.reduction.with_hook(state, hook)
        self.reduction.bind(self.layout)


def _hook(owner: weakref.ref, i: int, p: torch.Tensor) -> None:
    ddp = owner()
    if ddp is not None:
        ddp._on_grad_ready(i, p)


def _undefined_grad(ddp: DistributedDataParallel, p: torch.Tensor, view: torch.Tensor) -> None:
    """A hook saw .grad None: the gradient is undefined (an autograd.Function returned None, or
    UndefinedGrad). torch's reducer reduces zeros in its place: .grad is that average without
    find_unused_parameters; with it the parameter counts as unused here (`_launch` zeroes it
    and .grad stays None unless another rank used it)."""
    if ddp._expect_sync and not ddp.find_unused_parameters:
        view.zero_()
        p.grad = view


class _Skipped:
    """A bucket whose parameters are all unused here, under skip_all_reduce_unused_params (which
    needs find_unused_parameters): its gradients are not reduced, torch's meaning (the unused set
    must then be the same on every rank, as in torch); the last bucket's usage flags still are."""

    def __init__(self, flags_future):
        self.flags = flags_future

    def done(self) -> bool:
        return self.flags is None or self.flags.done()

    def wait(self):
        if self.flags is not None:
            self.flags.wait()
        return _Skipped


DDP = DistributedDataParallel
