"""The engine's ways of reducing a bucket: one small class each, behind one interface.

The reducer (minddp.engine.reducer) holds one `Reduction` and calls only its interface (bind,
launch, finish, shadow, usage_flags, replicas, with_hook): `AllReduce` (the default),
`CompressedAllReduce` (`compress="fp16"/"bf16"`), `CommHook` (`register_comm_hook`),
`ReduceScatter` (ZeRO-1, `shard_optimizer=True`). How a tensor's all-reduce runs (native,
ring, tree, ...) is the `Communicator`'s (minddp.engine.communicator), shared by all of them.
A launch returns what it started (`Started`: the future and, for the backend's own collective,
its Work).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import collectives
from . import grads
from .comm_hooks import GradBucket, compressed, returning_future
from .communicator import Communicator, Started


class Reduction:
    """How the engine reduces its buckets: one small class per way, one interface.

    The reducer calls `bind(layout)` after each (re)build of its buckets (`bind(None)` first, so
    the old buffers can go), `launch(b, fresh)` once bucket b is complete: its fresh gradients
    (parameters `fresh`, minddp.engine.grads) land in it and its reduction starts (returns
    `Started`), `finish(b, result)` once it was waited
    for (the result lands in the bucket's `.grad` buffer; returns the bytes that travelled),
    `shadow(b)` for a rank that ran out of data under join() (it contributes zeros, in the same
    order: returns the future), and `usage_flags(n)`, the reduced tail of the last bucket (None
    when this rank cannot see all of it).
    """

    kind = "all_reduce"  # for profiler ranges and traces
    pad_to = 1  # every bucket buffer is padded to a multiple of this
    joinable = True  # can a rank that ran out of data shadow it under join()?
    flat_params = False  # does the layout keep the parameters in flat buffers too (ZeRO-1)?

    def __init__(self, comm: Communicator, params: list[torch.Tensor]):
        self.comm, self.params, self.layout = comm, params, None
        self._flags = None

    def bind(self, layout) -> None:
        self.layout = layout
        self._flags = layout.flags(len(self.params)) if layout is not None else None

    def replicas(self, module, ignored=frozenset()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tensors that hold the module's parameters, for the first broadcast: (flat buffers
        that travel as they are, tensors that travel in coalesced chunks). Those `ignored` (by
        name) are never touched: they may be no plain tensor (a ShardedTensor)."""
        return [], [p.detach() for n, p in module.named_parameters() if n not in ignored]

    def with_hook(self, state, hook) -> "Reduction":
        """The reduction `register_comm_hook(state, hook)` installs in place of this one."""
        return CommHook(self.comm, self.params, state, hook)

    def launch(self, b: int, fresh: list[int]) -> Started:
        """Bucket b's fresh gradients into it (one call), then its reduction."""
        if fresh:
            grads.land(self.params, fresh, self.layout.views)
        return self._start(b, self.layout.buckets[b].buffer)

    def _start(self, b: int, buffer: torch.Tensor) -> Started:
        return self._reduce(b, buffer)

    def shadow(self, b: int):
        """Zeros in bucket b's place (a rank out of data under join()): the future to wait on."""
        return self._reduce(b, torch.zeros_like(self.layout.buckets[b].buffer)).future

    def _reduce(self, b: int, buffer: torch.Tensor) -> Started:
        """Start the reduction of `buffer` (bucket b's, or join's zeros)."""
        raise NotImplementedError

    def finish(self, b: int, result) -> int:
        buffer = self.layout.buckets[b].buffer
        if isinstance(result, list):  # torch's collectives give [tensor]
            result = result[0]
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result)
        return result.numel() * result.element_size()

    def usage_flags(self, n: int) -> torch.Tensor | None:
        return self._flags  # (the layout's n flags, taken at bind)

    def launch_sparse(self, b: int, grad: torch.Tensor) -> Started:
        """A sparse gradient is its own bucket (torch's rule): divided by the world size, then
        summed as it is (gloo's sparse all-reduce), in place."""
        return self.comm(grad)  # pre_divide: div_ by the group size, then SUM (torch's reducer)


class AllReduce(Reduction):
    """The bucket in its own dtype, in place: the backend's all-reduce, or one of
    minddp.comm.collectives' algorithms (ring, tree, ...) on the communicator's worker thread. The
    average's 1/n comes first (torch DDP's pre-division)."""

    def _reduce(self, b: int, buffer: torch.Tensor) -> Started:
        return self.comm(buffer)


class CompressedAllReduce(Reduction):
    """The bucket travels in 16 bits; `finish` copies the result back into the
    full-precision buffer, so stored gradients stay in their own dtype."""

    def __init__(self, comm: Communicator, params: list[torch.Tensor], dtype: torch.dtype):
        super().__init__(comm, params)
        self.dtype = dtype

    def _reduce(self, b: int, buffer: torch.Tensor) -> Started:
        return self.comm(compressed(buffer, self.dtype))


class CommHook(Reduction):
    """A torch-DDP-shaped hook, `hook(state, GradBucket) -> Future`
    (`DistributedDataParallel.register_comm_hook`)."""

    def __init__(self, comm: Communicator, params: list[torch.Tensor], state, hook):
        super().__init__(comm, params)
        self.state, self.hook = state, returning_future(hook)
        self._grad_buckets: list[GradBucket] = []  # what the hook sees of each bucket, per layout

    def bind(self, layout) -> None:
        super().bind(layout)
        buckets = layout.buckets if layout is not None else []
        self._grad_buckets = [self._grad_bucket(b, b.buffer) for b in buckets]

    def _grad_bucket(self, bucket, buffer: torch.Tensor) -> GradBucket:
        views = [self.layout.views[i] for i in bucket.param_ids] if buffer is bucket.buffer else []
        return GradBucket(bucket.index, buffer, [self.params[i] for i in bucket.param_ids],
                          views, bucket.index == len(self.layout.buckets) - 1, self.comm)

    def _start(self, b: int, buffer: torch.Tensor) -> Started:
        # a hook may chain collectives: its future is what ends it (no Work to time by)
        return Started(self.hook(self.state, self._grad_buckets[b]))

    def launch_sparse(self, b: int, grad: torch.Tensor) -> Started:
        """torch's GradBucket for a sparse parameter: its buffer is the sparse gradient itself."""
        i = self.layout.buckets[b].param_ids[0]
        return Started(self.hook(self.state, GradBucket(b, grad, [self.params[i]], [grad],
                                                        b == len(self.layout.buckets) - 1, self.comm)))

    def _reduce(self, b: int, buffer: torch.Tensor) -> Started:
        return Started(self.hook(self.state, self._grad_bucket(self.layout.buckets[b], buffer)))


class ReduceScatter(Reduction):
    """ZeRO-1 (minddp.optim.zero): each rank receives the average of its 1/n shard of the bucket,
    in place. Parameters live in flat buffers laid out like the buckets (layout.flat_params),
    so a shard of them can be stepped and all-gathered."""

    kind = "reduce_scatter"
    joinable = False  # a rank out of data would also have to take part in the optimizer's all-gather

    flat_params = True  # the layout keeps the parameters in flat buffers (Layout.build)

    def __init__(self, comm: Communicator, params: list[torch.Tensor]):
        super().__init__(comm, params)
        self.pad_to = dist.get_world_size(comm.group)

    def replicas(self, module, ignored=frozenset()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The flat parameter buffers as they are (no flattened copy), and any frozen parameter."""
        flat = {id(p) for p in self.params}
        return self.layout.flat_params, [p.detach() for n, p in module.named_parameters()
                                         if id(p) not in flat and n not in ignored]

    def _reduce(self, b: int, buffer: torch.Tensor) -> Started:
        # every element of a rank's bucket goes into some rank's shard sum: all of it is scaled
        # first, torch DDP's order
        self.comm.pre_divide(buffer)
        return Started(collectives.reduce_scatter_in_place(buffer, self.comm.group, dist.ReduceOp.SUM))

    def finish(self, b: int, result) -> int:  # in place: the shard already holds its average
        buffer = self.layout.buckets[b].buffer
        return buffer.numel() * buffer.element_size()

    def usage_flags(self, n: int) -> None:
        return None  # each rank holds only its shard of them

    def with_hook(self, state, hook) -> Reduction:
        raise ValueError("register_comm_hook does not combine with shard_optimizer=True: its buckets are "
                         "reduce-scattered (ZeRO-1), a comm hook all-reduces them")


def make_reduction(comm: Communicator, options, params) -> Reduction:
    """The engine's reduction for its options (minddp.engine.options.Options)."""
    if options.shard_optimizer:
        return ReduceScatter(comm, params)
    if options.compress in ("fp16", "bf16"):
        dtype = torch.float16 if options.compress == "fp16" else torch.bfloat16
        return CompressedAllReduce(comm, params, dtype)
    return AllReduce(comm, params)
