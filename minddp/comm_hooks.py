"""How one bucket of gradients is reduced: the engine's strategies and torch-style comm hooks.

The engine (ddp.py) holds one `Reduction` and calls only its interface (bind, launch,
finish, shadow, usage_flags): `AllReduce` (the default), `CompressedAllReduce`
(`compress="fp16"/"bf16"`), `CommHook` (`register_comm_hook`), `ReduceScatter` (ZeRO-1,
`shard_optimizer=True`). The algorithm (native, ring, rs_ag, tree, hierarchical) is the
`BucketReducer`'s, shared by all of them and by the hooks' `bucket.all_reduce`.

A hook has torch DDP's shape, `hook(state, bucket) -> Future`: it gets a
`GradBucket` and returns a future whose value is the reduced bucket, as a tensor
or a one-element list as torch's collectives give (any dtype; the engine copies
it back into the bucket's flat buffer). Register one with
`DistributedDataParallel.register_comm_hook(state, hook)`.

`bucket.all_reduce(t)` reduces with the engine's own group and averaging rule,
so a hook only decides *what* travels. The 16-bit hooks below run on gloo too
(torch's own bf16 hook refuses to run on CPU).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import collectives


def all_reduce_async(tensor: torch.Tensor, group, reduce_op: str) -> torch.futures.Future:
    """Start an in-place all-reduce of `tensor`; "avg" is torch DDP's: multiply by 1/size of the
    group, then SUM (never ReduceOp.AVG: NCCL runs float AVG as PreMulSum, which rules out NVLS on
    NVSwitch machines and sums in another order than torch DDP). The pre-division also keeps
    fp16 from overflowing.

    The future is torch's own (its value is `[tensor]`): no Python callback is
    chained here, because each one costs a GIL round trip on the comm thread.
    """
    if reduce_op == "avg":
        tensor.mul_(1.0 / dist.get_world_size(group))  # torch's reducer: mul by the reciprocal
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future()


# minddp.collectives' from-scratch all-reduces, each (tensor, group-or-node-groups, "sum")
ALGORITHMS = {
    "native": None,  # the backend's own all_reduce(async_op=True)
    "ring": collectives.ring_all_reduce,
    "rs_ag": collectives.all_reduce_via_rs_ag,
    "tree": collectives.tree_all_reduce,
    "hierarchical": collectives.hierarchical_all_reduce,
}


class BucketReducer:
    """Starts the all-reduce of one bucket and returns a future.

    "native" is the library's `all_reduce(async_op=True)`. The from-scratch algorithms of
    `minddp.collectives` are blocking calls made of smaller collectives:
    - on NCCL they run right here, on the calling (autograd) thread, on their own CUDA stream
      that first waits for the compute stream (the gradients are final there): NCCL calls are
      asynchronous for the host anyway, and one issuing thread keeps every NCCL call (these and
      tensor parallelism's) in the same order on every rank;
    - elsewhere (gloo, whose calls block the host) on one worker thread, in submission order,
      so backward keeps computing while they travel; with CUDA tensors the worker sets the
      device and uses the same side stream.
    A CUDA future carries its device, so `wait()` makes the waiting stream wait for the side
    stream, not the host.
    """

    def __init__(self, group, reduce_op: str = "avg", algorithm: str = "native",
                 ranks_per_node: int | None = None):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {tuple(ALGORITHMS)}, got {algorithm!r}")
        self.group, self.reduce_op, self.algorithm = group, reduce_op, algorithm
        self.world = dist.get_world_size(group)
        self._run = ALGORITHMS[algorithm]
        self._target = (collectives.NodeGroups(group, ranks_per_node)
                        if algorithm == "hierarchical" else group)
        self._inline = "nccl" in str(dist.get_backend(group))
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="minddp-comm")
                      if algorithm != "native" and not self._inline else None)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.futures.Future:
        if self._run is None:
            return all_reduce_async(tensor, self.group, self.reduce_op)
        if self.reduce_op == "avg":  # as all_reduce_async: scale, then SUM
            tensor.mul_(1.0 / self.world)
        if not tensor.is_cuda:
            return self._submit(torch.futures.Future(), tensor, None, None)
        stream = self._streams.setdefault(tensor.device, torch.cuda.Stream(tensor.device))
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream: the bucket's gradients are final here
        tensor.record_stream(stream)  # a temporary (a 16-bit copy) is not reused before we finish
        return self._submit(torch.futures.Future(devices=[tensor.device]), tensor, stream, ready)

    def _submit(self, fut, tensor, stream, ready) -> torch.futures.Future:
        def run():
            try:
                if stream is None:
                    self._run(tensor, self._target, "sum")
                    return fut.set_result(tensor)
                with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    self._run(tensor, self._target, "sum")
                    fut.set_result(tensor)  # records an event on the side stream for wait()
            except BaseException as e:  # noqa: BLE001 - surfaced by fut.wait() on the main thread
                fut.set_exception(e)

        if self._pool is None:
            run()
        else:
            self._pool.submit(run)
        return fut


@dataclass
class GradBucket:
    """What a hook sees of one bucket (mirrors torch's `dist.GradBucket`)."""

    _index: int
    _buffer: torch.Tensor
    _params: list[torch.Tensor]
    _grads: list[torch.Tensor]
    _is_last: bool
    reducer: BucketReducer

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer. The last bucket carries a few extra flag
        elements after the gradients; reduce the whole buffer."""
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def is_last(self) -> bool:
        return self._is_last

    @property
    def group(self):
        return self.reducer.group

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """All-reduce `tensor` in place with the engine's group, op (avg or sum) and algorithm."""
        return self.reducer(tensor)


def allreduce_hook(state, bucket: GradBucket) -> torch.futures.Future:
    """The default: reduce the bucket in its own dtype, in place."""
    return bucket.all_reduce(bucket.buffer())


def _compress_hook(dtype: torch.dtype):
    def hook(state, bucket: GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        if buffer.dtype == dtype:
            return bucket.all_reduce(buffer)
        # Travel in 16 bits; the engine copies the result back into the
        # full-precision buffer, so stored gradients stay in their own dtype.
        return bucket.all_reduce(buffer.to(dtype))

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

BUILTIN_HOOKS = {None: allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}


# ------------------------------------------------------------ reduction strategies
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

    def __init__(self, reducer: BucketReducer, params: list[torch.Tensor]):
        self.reducer, self.params, self.layout = reducer, params, None

    def bind(self, layout) -> None:
        self.layout = layout

    def replicas(self, module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tensors that hold the module's parameters, for the first broadcast: (flat buffers
        that travel as they are, tensors that travel in coalesced chunks)."""
        return [], [p.detach() for p in module.parameters()]

    def with_hook(self, state, hook) -> "Reduction":
        """The reduction `register_comm_hook(state, hook)` installs in place of this one."""
        return CommHook(self.reducer, self.params, state, hook)

    def launch(self, b: int):
        return self._reduce(b, self.layout.buckets[b].buffer)

    def shadow(self, b: int):
        return self._reduce(b, torch.zeros_like(self.layout.buckets[b].buffer))

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
        return self.layout.buckets[-1].buffer[-n:]


class AllReduce(Reduction):
    """The bucket in its own dtype, in place: the backend's all-reduce, or one of
    minddp.collectives' algorithms (ring, tree, ...) on the reducer's worker thread."""

    def _reduce(self, b: int, buffer: torch.Tensor):
        return self.reducer(buffer)


class CompressedAllReduce(Reduction):
    """The bucket travels in 16 bits; `finish` copies the result back into the
    full-precision buffer, so stored gradients stay in their own dtype."""

    def __init__(self, reducer: BucketReducer, params: list[torch.Tensor], dtype: torch.dtype):
        super().__init__(reducer, params)
        self.dtype = dtype

    def _reduce(self, b: int, buffer: torch.Tensor):
        return self.reducer(buffer if buffer.dtype == self.dtype else buffer.to(self.dtype))


class CommHook(Reduction):
    """A torch-DDP-shaped hook, `hook(state, GradBucket) -> Future`
    (`DistributedDataParallel.register_comm_hook`)."""

    def __init__(self, reducer: BucketReducer, params: list[torch.Tensor], state, hook):
        super().__init__(reducer, params)
        self.state, self.hook = state, hook

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

    def _reduce(self, b: int, buffer: torch.Tensor):
        return self.hook(self.state, self._grad_bucket(self.layout.buckets[b], buffer))


class ReduceScatter(Reduction):
    """ZeRO-1 (minddp.zero): each rank receives the average of its 1/n shard of the bucket,
    in place. Parameters live in flat buffers laid out like the buckets (layout.flat_params),
    so a shard of them can be stepped and all-gathered."""

    kind = "reduce_scatter"
    joinable = False  # a rank out of data would also have to take part in the optimizer's all-gather

    def __init__(self, reducer: BucketReducer, params: list[torch.Tensor]):
        super().__init__(reducer, params)
        self.pad_to = dist.get_world_size(reducer.group)
        self.avg = reducer.reduce_op == "avg"

    def bind(self, layout) -> None:
        super().bind(layout)
        if layout is not None:
            layout.flat_params = flatten_params(self.params, layout)

    def replicas(self, module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The flat parameter buffers as they are (no flattened copy), and any frozen parameter."""
        flat = {id(p) for p in self.params}
        return self.layout.flat_params, [p.detach() for p in module.parameters() if id(p) not in flat]

    def _reduce(self, b: int, buffer: torch.Tensor):
        if self.avg:  # torch DDP's average: scale by 1/n, then SUM (as all_reduce_async)
            buffer.mul_(1.0 / self.reducer.world)
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
