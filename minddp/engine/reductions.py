"""The engine's ways of reducing a bucket: one small class each, behind one interface.

The engine (ddp.py) holds one `Reduction` and calls only its interface (bind, launch,
finish, shadow, usage_flags, replicas, with_hook): `AllReduce` (the default),
`CompressedAllReduce` (`compress="fp16"/"bf16"`), `CommHook` (`register_comm_hook`),
`ReduceScatter` (ZeRO-1, `shard_optimizer=True`). How the all-reduce itself runs (native,
ring, tree, ...) is the `BucketReducer`'s (minddp.engine.comm_hooks), shared by all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import collectives
from .comm_hooks import BucketReducer, GradBucket, compressed, returning_future


class Reduction:
    """How the engine reduces its buckets: one small class per way, one interface.

    The engine calls `bind(layout)` after each (re)build of its buckets (`bind(None)` first, so
    the old buffers can go), `launch(b)` to start bucket b's reduction (a future, or a Work
    wrapper with done()/wait()), `finish(b, result)` once it was waited for (the result lands
    in the bucket's buffer; returns the bytes that travelled), `shadow(b)` for a rank that ran
    out of data under join() (it contributes zeros, in the same order), and `usage_flags(n)`,
    the reduced tail of the last bucket (None when this rank cannot see all of it).
    """

    kind = "all_reduce"  # for profiler ranges and traces
    pad_to = 1  # every bucket buffer is padded to a multiple of this
    joinable = True  # can a rank that ran out of data shadow it under join()?
    prescale: float | None = None  # 1/n when the bucket is averaged by scaling it before a SUM

    def __init__(self, reducer: BucketReducer, params: list[torch.Tensor]):
        self.reducer, self.params, self.layout = reducer, params, None

    def bind(self, layout) -> None:
        self.layout = layout
        self._scaled = [False] * len(self.params)  # this gradient was scaled on its way into the bucket
        self._scaled_in = [0] * (len(layout.buckets) if layout is not None else 0)  # ... how many, per bucket

    def copy_in(self, i: int, view: torch.Tensor, grad: torch.Tensor, syncing: bool) -> None:
        """A fresh gradient into its bucket view. Before a synchronised reduction that averages by
        pre-scaling, the 1/n is fused into the copy (torch's reducer does the same, mul_out), so the
        bucket needs no second pass; gradients accumulated in place are scaled at launch instead."""
        if self.prescale is None or not syncing:
            view.copy_(grad)
            return
        if grad.requires_grad:  # create_graph=True: out= refuses tensors that require grad
            view.copy_(grad.mul(self.prescale))
        else:
            torch.mul(grad, self.prescale, out=view)
        if not self._scaled[i]:
            self._scaled[i] = True
            self._scaled_in[self.layout.bucket_of(i)] += 1

    def scale_rest(self, b: int) -> None:
        """Scale what copy_in did not (the whole bucket when it scaled nothing: accumulated in
        place), so every element of bucket b carries the 1/n once; then forget the marks."""
        bucket, n = self.layout.buckets[b], self._scaled_in[b]
        if n == 0:
            self.reducer.pre_divide(bucket.buffer)
            return
        for i in bucket.param_ids:  # the usage-flag tail stays unscaled: only nonzero matters there
            if not self._scaled[i]:
                self.reducer.pre_divide(self.layout.views[i])
            self._scaled[i] = False
        self._scaled_in[b] = 0

    def replicas(self, module, ignored=frozenset()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tensors that hold the module's parameters, for the first broadcast: (flat buffers
        that travel as they are, tensors that travel in coalesced chunks). Those `ignored` (by
        name) are never touched: they may be no plain tensor (a ShardedTensor)."""
        return [], [p.detach() for n, p in module.named_parameters() if n not in ignored]

    def with_hook(self, state, hook) -> "Reduction":
        """The reduction `register_comm_hook(state, hook)` installs in place of this one."""
        return CommHook(self.reducer, self.params, state, hook)

    def launch(self, b: int):
        return self._reduce(b, self.layout.buckets[b].buffer)

    def shadow(self, b: int):
        future = self._reduce(b, torch.zeros_like(self.layout.buckets[b].buffer))
        self.take_work()  # no observer times a joined rank's zeros: keep no Work past the step
        return future

    def take_work(self):
        """The Work of the collective `launch` just started, if the backend's own (for timing)."""
        return self.reducer.take_work()

    def _reduce(self, b: int, buffer: torch.Tensor):
        raise NotImplementedError

    def finish(self, b: int, result) -> int:
        buffer = self.layout.buckets[b].buffer
        if isinstance(result, list):  # torch's collectives give [tensor]
            result = result[0]
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result)
        return result.numel() * result.element_size()

    def usage_flags(self, n: int) -> torch.Tensor | None:
        return self.layout.flags(n)

    def launch_sparse(self, b: int, grad: torch.Tensor):
        """A sparse gradient is its own bucket (torch's rule): divided by the world size, then
        summed as it is (gloo's sparse all-reduce), in place."""
        return self.reducer(grad)  # pre_divide: div_ by the group size, then SUM (torch's reducer)


class AllReduce(Reduction):
    """The bucket in its own dtype, in place: the backend's all-reduce, or one of
    minddp.comm.collectives' algorithms (ring, tree, ...) on the reducer's worker thread. The average's
    1/n is applied as gradients are copied into the bucket (`copy_in`), not in a pass of its own."""

    def __init__(self, reducer: BucketReducer, params: list[torch.Tensor]):
        super().__init__(reducer, params)
        self.prescale = reducer.average

    def _reduce(self, b: int, buffer: torch.Tensor):
        if self.prescale is None or buffer is not self.layout.buckets[b].buffer:  # (join's zeros)
            return self.reducer(buffer)
        self.scale_rest(b)
        return self.reducer(buffer, prescaled=True)


class CompressedAllReduce(Reduction):
    """The bucket travels in 16 bits; `finish` copies the result back into the
    full-precision buffer, so stored gradients stay in their own dtype."""

    def __init__(self, reducer: BucketReducer, params: list[torch.Tensor], dtype: torch.dtype):
        super().__init__(reducer, params)
        self.dtype = dtype

    def _reduce(self, b: int, buffer: torch.Tensor):
        return self.reducer(compressed(buffer, self.dtype))


class CommHook(Reduction):
    """A torch-DDP-shaped hook, `hook(state, GradBucket) -> Future`
    (`DistributedDataParallel.register_comm_hook`)."""

    def __init__(self, reducer: BucketReducer, params: list[torch.Tensor], state, hook):
        super().__init__(reducer, params)
        self.state, self.hook = state, returning_future(hook)

    def bind(self, layout) -> None:
        super().bind(layout)
        buckets = layout.buckets if layout is not None else []
        self._grad_buckets = [self._grad_bucket(b, b.buffer) for b in buckets]

    def _grad_bucket(self, bucket, buffer: torch.Tensor) -> GradBucket:
        views = [self.layout.views[i] for i in bucket.param_ids] if buffer is bucket.buffer else []
        return GradBucket(bucket.index, buffer, [self.params[i] for i in bucket.param_ids],
                          views, bucket.index == len(self.layout.buckets) - 1, self.reducer)

    def launch(self, b: int):
        return self.hook(self.state, self._grad_buckets[b])

    def launch_sparse(self, b: int, grad: torch.Tensor):
        """torch's GradBucket for a sparse parameter: its buffer is the sparse gradient itself."""
        i = self.layout.buckets[b].param_ids[0]
        return self.hook(self.state, GradBucket(b, grad, [self.params[i]], [grad],
                                                b == len(self.layout.buckets) - 1, self.reducer))

    def take_work(self):
        self.reducer.take_work()  # a hook may chain collectives: its future is what ends it
        return None

    def _reduce(self, b: int, buffer: torch.Tensor):
        return self.hook(self.state, self._grad_bucket(self.layout.buckets[b], buffer))


class ReduceScatter(Reduction):
    """ZeRO-1 (minddp.optim.zero): each rank receives the average of its 1/n shard of the bucket,
    in place. Parameters live in flat buffers laid out like the buckets (layout.flat_params),
    so a shard of them can be stepped and all-gathered."""

    kind = "reduce_scatter"
    joinable = False  # a rank out of data would also have to take part in the optimizer's all-gather

    def __init__(self, reducer: BucketReducer, params: list[torch.Tensor]):
        super().__init__(reducer, params)
        self.pad_to = dist.get_world_size(reducer.group)
        # every element of a rank's bucket goes into some rank's shard sum: all of it is scaled
        # first, torch DDP's order; mostly inside the copy of each gradient into the bucket (copy_in)
        self.prescale = reducer.average

    def bind(self, layout) -> None:
        super().bind(layout)
        if layout is not None:
            layout.flat_params = flatten_params(self.params, layout)

    def replicas(self, module, ignored=frozenset()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The flat parameter buffers as they are (no flattened copy), and any frozen parameter."""
        flat = {id(p) for p in self.params}
        return self.layout.flat_params, [p.detach() for n, p in module.named_parameters()
                                         if id(p) not in flat and n not in ignored]

    def _reduce(self, b: int, buffer: torch.Tensor):
        if self.prescale is not None and buffer is self.layout.buckets[b].buffer:  # 1/n, then SUM
            self.scale_rest(b)
        else:
            self.reducer.pre_divide(buffer)
        return collectives.reduce_scatter_in_place(buffer, self.reducer.group, dist.ReduceOp.SUM)

    def finish(self, b: int, result) -> int:  # in place: the shard already holds its average
        buffer = self.layout.buckets[b].buffer
        return buffer.numel() * buffer.element_size()

    def usage_flags(self, n: int) -> None:
        return None  # each rank holds only its shard of them

    def with_hook(self, state, hook) -> Reduction:
        raise ValueError("register_comm_hook does not combine with shard_optimizer=True: its buckets are "
                         "reduce-scattered (ZeRO-1), a comm hook all-reduces them")


@torch.no_grad()
def flatten_params(params: list[torch.Tensor], layout) -> list[torch.Tensor]:
    """Parameters become views of flat buffers laid out like the gradient buckets, one bucket
    at a time: a parameter's old storage goes as soon as nothing else holds it."""
    flats = []
    for bucket in layout.buckets:
        flat = torch.zeros_like(bucket.buffer)
        for k, i in enumerate(bucket.param_ids):
            p = params[i]
            view = flat[bucket.offsets[k] : bucket.offsets[k] + bucket.numels[k]].view(p.shape)
            view.copy_(p)
            p.data = view
        flats.append(flat)
    return flats


def make_reduction(reducer: BucketReducer, compress: str | None, shard: bool, params) -> Reduction:
    """The engine's reduction for its constructor options."""
    if shard:
        return ReduceScatter(reducer, params)
    if compress in ("fp16", "bf16"):
        return CompressedAllReduce(reducer, params, torch.float16 if compress == "fp16" else torch.bfloat16)
    return AllReduce(reducer, params)
