"""minddp.DistributedDataParallel: torch DDP, in Python. This file is the wrapper, a thin
`nn.Module`; the iteration itself is the reducer's (minddp.engine.reducer), in torch's four phases.

One iteration (a forward outside `no_sync()`, then `loss.backward()`):

1. forward (here): broadcast the buffers from the group's first rank (re-read: one may have been
   reassigned; through `.data`, so a tensor an earlier forward saved for backward is not marked
   modified, as torch's broadcast does not bump autograd's version counter); the module runs;
   then (as torch's `_post_forward`: a forward that raised starts nothing), if grad is enabled and
   `require_backward_grad_sync`, **prepare for backward**: `reducer.prepare_for_backward()` resets
   every per-iteration flag, and `reducer.watch(output)` puts a prehook on the output's autograd
   nodes: the backward of *this* graph will reach them. A forward that will not be followed by a
   synchronised backward (no_grad, `no_sync()`) leaves a pending backward alone.
2. backward, **mark ready**: autograd accumulates each gradient straight into its bucket's flat
   buffer (`param.grad` is a view of it; a fresh gradient is copied in with the average's 1/n
   fused). A post-accumulate hook calls `reducer.autograd_hook(i)`, which marks parameter i ready
   (under `static_graph`, at its last hook: a shared weight gets several).
3. **launch in order**: bucket b goes out (asynchronously, overlapping the rest of backward) as
   soon as bucket b and every bucket before it are complete: strictly in index order on every
   rank, whatever order autograd delivers gradients in. That is when bucket i goes out.
4. **finalize**, queued once on the autograd engine, when the backward of the forward's graph
   reaches its output (not a reentrant checkpoint's nested recomputation), or when the last
   bucket is launched: launch what is left (buckets with unused parameters, everything under
   `overlap=False` or in a static graph's first iteration), wait for every bucket in order, copy
   the usage flags to the host without waiting. After the first iteration the buckets are rebuilt
   once in the observed gradient-ready order (rank 0's, broadcast).

When `loss.backward()` returns, finalize has run: every `param.grad` holds the average over ranks.
That is when the step's gradient is final. `on_reduced(fn)` callbacks run with b right after
bucket b's wait (minddp.optim.overlap steps bucket b there); `on_rebuild(fn)` before a rebuild.

Beside the iteration, each seam is the reducer's client through public methods: how a bucket
is reduced (`reducer.reduction`, minddp.engine.reductions; the average's 1/n is decided in one
place, `BucketReducer.pre_divide`, and fused into each fresh gradient's copy), what is recorded (`observer`),
usage flags (minddp.engine.usage), uneven inputs (minddp.engine.join), pickling
(minddp.engine.pickling). The constructor's arguments and what a script reads beside the step:
minddp.engine.ddp_api.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .. import _compat
from . import checks, replicas
from . import join as _join
from .ddp_api import PublicAPI
from .reducer import Reducer


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
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view  # as given (gradients are bucket views)
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params and find_unused_parameters
        self.batched_grad_copy = batched_grad_copy  # accepted: each gradient is one copy already
        self.options = dict(reduce_op=reduce_op, compress=compress, algorithm=algorithm,
                            ranks_per_node=ranks_per_node, shard_optimizer=shard_optimizer,
                            bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=bucket_cap_mb_list,
                            strict_bucket_cap=strict_bucket_cap, overlap=overlap,
                            find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                            optimizer_overlap=optimizer_overlap)  # what the reducer is built from
        self.retired = False  # a newer wrapper took the module over (checks.take_over)
        self.ignored_names = checks.ignored_names(module)  # _set_params_and_buffers_to_ignore_for_model
        named = [(n, p) for n, p in module.named_parameters()
                 if p.requires_grad and n not in self.ignored_names]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        checks.check_trainable(self.names)
        self.build_reducer(list(reversed(range(len(self.params)))))
        checks.check_same_model(module, self.names, self.process_group, self.ignored_names)
        if init_sync:  # torch's init_sync=False: the caller guarantees equal replicas
            replicas.init_sync(self, module, init_sync_buffers)
        self.attach_hooks(module)
        self.require_backward_grad_sync = True  # False inside no_sync(); torch DDP's attribute
        self.require_forward_param_sync = True  # torch DDP's rule for buffer broadcast

    def build_reducer(self, order: list[int]) -> None:
        """The reducer for this wrapper's parameters, buckets in `order`; no collective (the
        constructor and unpickling)."""
        self.world_size = dist.get_world_size(self.process_group)
        self.src_rank = dist.get_process_group_ranks(self.process_group)[0]  # global (broadcast's src)
        self.device = self.params[0].device
        self.reducer = Reducer(self.params, self.names, self.process_group, self.device, self.options,
                               sparse=[_produces_sparse_gradient(self.module, n) for n in self.names])
        self.reducer.build_layout(order)

    def attach_hooks(self, module: nn.Module) -> None:
        # hooks hold a weak reference: a dropped wrapper removes its hooks (finalizer)
        me = weakref.ref(self.reducer)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, me, i))
                       for i, p in enumerate(self.params)]
        self._finalizer = weakref.finalize(self, checks.release, self._hooks, weakref.ref(module),
                                           weakref.ref(self))
        checks.take_over(module, self)  # an older wrapper of this module is retired

    def retire(self) -> None:
        """A newer wrapper took the module over: this one's forward raises from now on."""
        self.remove_hooks()
        self.retired = True

    @property
    def module_buffers(self) -> list[torch.Tensor]:
        """The buffers each forward broadcasts, re-read each time (minddp.engine.replicas)."""
        return replicas.synced_buffers(self.module, self.ignored_names)

    # the reducer's state, read by scripts, tools and tests under the names they always had
    layout = property(lambda self: self.reducer.layout, doc="Where every gradient lives (buckets.Layout).")
    reduction = property(lambda self: self.reducer.reduction, doc="How a bucket is reduced.")
    observer = property(lambda self: self.reducer.observer, doc="What is recorded about communication.")
    usage = property(lambda self: self.reducer.usage, doc="The unused-parameter flags.")
    rebuilt = property(lambda self: self.reducer.rebuilt, doc="The buckets were rebuilt (once).")

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        if self.retired:
            checks.retired_error()
        self.usage.check()  # the last backwards' usage flags, once landed (minddp.engine.usage)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        bcast = self.require_forward_param_sync and self.forward_sync_buffers and self.world_size > 1
        src = self.src_rank
        if self.reducer.uneven is not None:  # tell the ranks that ran out of data what this iteration does
            src = self.reducer.uneven.on_forward(sync, bcast)
        if bcast:
            replicas.broadcast_buffers(self.module_buffers, self.process_group, src)
        self.require_forward_param_sync = sync
        with _compat.dynamo_sees_ddp(self):  # a compiled model: one subgraph per bucket, as torch DDP
            output = self.module(*args, **kwargs)
        # after the module, as torch's _post_forward: a forward that raised starts no iteration.
        # False: a checkpoint's recomputation inside this iteration's backward, which goes on.
        if sync and self.reducer.prepare_for_backward():
            self.reducer.watch(output)  # the backward of this graph finalizes the iteration
        # otherwise a pending backward (forward, no-grad forward, backward) is left alone
        return output

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
        """Replace how buckets are reduced: `hook(state, GradBucket) -> Future`. Once (torch's rule)."""
        with self.logging_errors():  # torch's logger records them: _get_ddp_logging_data()
            checks.check_comm_hook(hook)  # torch's checks, at registration
        self.reducer.register_comm_hook(state, hook)


def _hook(owner: weakref.ref, i: int, p: torch.Tensor) -> None:
    reducer = owner()
    if reducer is not None:
        reducer.autograd_hook(i, p)


def _produces_sparse_gradient(module: nn.Module, name: str) -> bool:
    """torch's `_check_sparse`: a parameter of nn.Embedding/EmbeddingBag(sparse=True)."""
    owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
    return isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and owner.sparse


DDP = DistributedDataParallel
