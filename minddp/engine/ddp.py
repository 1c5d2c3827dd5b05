"""minddp.DistributedDataParallel: torch DDP, in Python. This file is the wrapper, a thin
`nn.Module`: phase 1 of an iteration (minddp.engine's docstring tells the four), `no_sync`,
`join`, `_set_static_graph`, `register_comm_hook`, pickling; what a script reads beside the step
is minddp.engine.ddp_api's.

The forward broadcasts the buffers from the group's first rank when torch would (re-read: one may
have been reassigned; through `.data`, so a tensor an earlier forward saved for backward is not
marked modified, as torch's broadcast does not bump autograd's version counter), runs the module,
and then, as torch's `_post_forward` (a forward that raised starts nothing; what the module did to
the sync flags is read here, after it), prepares the backward. When `loss.backward()` returns,
every `param.grad` holds the average over ranks. `on_reduced(fn)` callbacks run with b right after
bucket b's wait (minddp.optim.overlap steps bucket b there); `on_rebuild(fn)` before a rebuild.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .. import _compat
from . import checks, hooks, pickling, replicas
from . import join as _join
from .ddp_api import Logger, PublicAPI
from .mixed_precision import MixedPrecision
from .options import Options
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
        self.logger = Logger()  # what torch's logger records that minddp has: the last error
        compress = checks.normalise_compress(compress)
        checks.check_arguments(reduce_op, compress, bucket_cap_mb, shard_optimizer, algorithm,
                               find_unused_parameters, optimizer_overlap, bucket_cap_mb_list)
        process_group = checks.torch_arguments(module, device_ids, process_group, device_mesh,
                                               delay_all_reduce_named_params, param_to_hook_all_reduce)
        checks.check_not_wrapped(module, DistributedDataParallel)
        self.forward_sync_buffers, init_sync_buffers = checks.buffer_sync(
            broadcast_buffers, forward_sync_buffers, check_reduction)  # torch 2.13's rule and warnings
        self.options = Options(
            reduce_op=reduce_op, compress=compress, algorithm=algorithm, ranks_per_node=ranks_per_node,
            shard_optimizer=shard_optimizer, mixed_precision=mixed_precision,
            bucket_cap_mb=bucket_cap_mb, strict_bucket_cap=strict_bucket_cap,
            bucket_cap_mb_list=tuple(bucket_cap_mb_list) if bucket_cap_mb_list is not None else None,
            overlap=overlap, find_unused_parameters=find_unused_parameters,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params, optimizer_overlap=optimizer_overlap,
            gradient_as_bucket_view=gradient_as_bucket_view, batched_grad_copy=batched_grad_copy, dim=dim,
            **checks.torch_devices(module, device_ids, output_device))
        self.module = module
        self.process_group, self.device_mesh = process_group, device_mesh  # torch DDP's attributes
        self.retired = False  # a newer wrapper took the module over (minddp.engine.hooks)
        self.uneven: _join.Join | None = None  # inside join(): who still trains, this iteration's scale
        # torch's name: what _set_params_and_buffers_to_ignore_for_model left out
        self.parameters_to_ignore = checks.ignored_names(module)
        # torch's will_sync_module_buffers: the buffers are re-read at each forward only while the
        # last read found some (a model without buffers is never walked)
        self.has_module_buffers = bool(self.module_buffers)
        named = [(n, p) for n, p in module.named_parameters()
                 if p.requires_grad and n not in self.parameters_to_ignore]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        checks.check_trainable(self.names)
        self.world_size = dist.get_world_size(self.process_group)
        self.src_rank = dist.get_process_group_ranks(self.process_group)[0]  # global (broadcast's src)
        self.device = self.params[0].device
        self.mixed = MixedPrecision.of(mixed_precision, module, self.params, self.parameters_to_ignore,
                                       self.options)
        self.reducer = self._new_reducer(list(reversed(range(len(self.params)))))
        checks.check_same_model(module, self.names, self.process_group, self.parameters_to_ignore)
        if init_sync:  # torch's init_sync=False: the caller guarantees equal replicas
            replicas.init_sync(self, module, init_sync_buffers)
        if self.mixed is not None:  # torch casts the buffers once, after the init sync
            self.mixed.cast_buffers()
        self._finalizer = hooks.attach(self, module, self.reducer)
        self.require_backward_grad_sync = True  # False inside no_sync(); torch DDP's attribute
        self.require_forward_param_sync = True  # torch DDP's rule for buffer broadcast
        if static_graph:  # as torch's constructor does
            self._set_static_graph()

    def _new_reducer(self, order: list[int]) -> Reducer:
        """The reducer for this wrapper's parameters, buckets in `order`; no collective (the
        constructor and unpickling)."""
        sparse = [_produces_sparse_gradient(self.module, n) for n in self.names]
        reducer = Reducer(self.params, self.names, self.process_group, self.device, self.options, sparse,
                          mixed=self.mixed)
        reducer.build_layout(order)
        return reducer

    def retire(self) -> None:
        """A newer wrapper took the module over: this one's forward raises from now on."""
        self.remove_hooks()
        self.retired = True

    def _set_static_graph(self) -> None:
        """torch DDP's (private by name, called by the Hugging Face Trainer and many scripts right
        after wrapping): the graph is the same every iteration; before the first one, once."""
        if self.static_graph:  # torch's warning, word for word
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        with self.logging_errors():
            self.reducer.set_static_graph()
        if self.find_unused_parameters:  # torch's warning, word for word
            warnings.warn("You passed find_unused_parameters=true to DistributedDataParallel, "
                          "`_set_static_graph` will detect unused parameters automatically, so you do not "
                          "need to set find_unused_parameters=true, just be sure these unused parameters "
                          "will not change during training loop while calling `_set_static_graph`.",
                          stacklevel=2)

    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's deprecated name of `forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        if self.retired:
            hooks.retired_error()
        self.usage.check()  # the last backwards' usage flags, once landed (minddp.engine.usage)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        bcast = (self.require_forward_param_sync and self.forward_sync_buffers and self.world_size > 1
                 and self.has_module_buffers)
        src, grad_scale = self.src_rank, None
        if self.uneven is not None:  # tell the ranks that ran out of data what this iteration does
            src = self.uneven.on_forward(sync, bcast)
            grad_scale = self.uneven.grad_scale()
        if bcast:
            buffers = self.module_buffers
            self.has_module_buffers = bool(buffers)
            replicas.broadcast_buffers(buffers, self.process_group, src)
        output = self._run_module(args, kwargs)
        self._post_forward(output, grad_scale)
        return output

    @_compat.eager
    def _post_forward(self, output, grad_scale: float | None) -> None:
        """After the module, as torch's: a forward that raised starts no iteration, and what the
        module did to the sync flags (Lightning toggles them) is read here. The iteration ends at
        the backward that reaches `output`; a checkpoint's recomputation inside this iteration's
        backward starts none (it goes on). Otherwise a pending backward is left alone."""
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.require_forward_param_sync = sync
        if sync:
            self.reducer.prepare_for_backward(output, grad_scale=grad_scale)

    def _run_module(self, args, kwargs):
        if self.mixed is None:
            with _compat.dynamo_sees_ddp(self):  # a compiled model: one subgraph per bucket, as torch DDP
                return self.module(*args, **kwargs)
        # the forward sees parameters and inputs in param_dtype (minddp.engine.mixed_precision)
        args, kwargs, restore = self.mixed.to_compute(args, kwargs, self.layout)
        try:
            with _compat.dynamo_sees_ddp(self):
                return self.module(*args, **kwargs)
        finally:
            if restore:  # a no_grad forward: no backward will need the param_dtype copies
                self.mixed.to_full_precision(None)

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

    @contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Uneven inputs (torch's `Join`, torch's arguments): wrap the training loop; a rank that
        runs out of data shadows the others' collectives until every rank is done (minddp.engine.join).
        Gradients are averaged over the initial world size, or over the ranks still training."""
        if not enable:  # torch: the inputs are even, nothing to detect
            yield
            return
        _join.check_joinable(self.reduction)
        self.uneven = _join.Join(self, divide_by_initial_world_size, throw_on_early_termination)
        try:
            yield
            self.uneven.shadow_until_all_joined()  # a rank out of data: the others' collectives
        finally:
            self.uneven = None

    def register_comm_hook(self, state, hook) -> None:
        """Replace how buckets are reduced: `hook(state, GradBucket) -> Future`. Once (torch's rule)."""
        with self.logging_errors():  # torch's logger records them: _get_ddp_logging_data()
            checks.check_comm_hook(hook)  # torch's checks, at registration
            if self.mixed is not None:
                self.mixed.refuse_comm_hook()
        self.reducer.register_comm_hook(state, hook)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self):
        return pickling.getstate(self)

    def __setstate__(self, state) -> None:
        state, order, static_graph = pickling.restored(state)  # the per-process parts were dropped
        nn.Module.__setstate__(self, state)
        self.mixed = MixedPrecision.of(self.options.mixed_precision, self.module, self.params,
                                       self.parameters_to_ignore, self.options)
        self.reducer = self._new_reducer(order)
        if static_graph:
            self.reducer.set_static_graph()
        self._finalizer = hooks.attach(self, self.module, self.reducer)


def _produces_sparse_gradient(module: nn.Module, name: str) -> bool:
    """torch's `_check_sparse`: a parameter of nn.Embedding/EmbeddingBag(sparse=True)."""
    owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
    return isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and owner.sparse


DDP = DistributedDataParallel
