"""How one bucket is all-reduced: the algorithm (`BucketReducer`) and torch-style comm hooks.

`BucketReducer` starts a bucket's all-reduce with the engine's group and averaging rule, by
the backend (native) or one of minddp.comm.collectives' algorithms (a table, `ALGORITHMS`). The
engine's ways of reducing a bucket (all-reduce, compressed, a hook, ZeRO-1's reduce-scatter)
are minddp.engine.reductions'.

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

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _compat
from ..comm import collectives


def all_reduce_work(tensor: torch.Tensor, group) -> dist.Work:
    """Start an in-place SUM all-reduce of `tensor` (the average's 1/n applied before it, by
    `BucketReducer.pre_divide`) and return the Work, whose wait() orders the waiting CUDA stream
    after the collective's own end event, without recording the tensor on that stream. Its future
    is torch's own (value `[tensor]`): no Python callback is chained (a GIL round trip each)."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


# minddp.comm.collectives' from-scratch all-reduces, each (tensor, group-or-node-groups, "sum")
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
    `minddp.comm.collectives` are blocking calls made of smaller collectives:
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
        # the average's 1/n, the one place it is decided (see pre_divide)
        self.average = 1.0 / self.world if reduce_op == "avg" else None
        self._run = ALGORITHMS[algorithm]
        self._target = (collectives.NodeGroups(group, ranks_per_node)
                        if algorithm == "hierarchical" else group)
        self._inline = "nccl" in str(dist.get_backend(group))
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="minddp-comm")
                      if algorithm != "native" and not self._inline else None)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._work = None  # the last native collective's Work, until take_work()

    def pre_divide(self, tensor: torch.Tensor) -> None:
        """torch DDP's average, applied before a SUM: x * (1/n) (a sparse gradient x / n, as
        torch's reducer). Never ReduceOp.AVG: NCCL runs float AVG as PreMulSum, which rules out
        NVLS on NVSwitch machines and sums in another order than torch DDP; dividing first also
        keeps fp16 from overflowing. The engine fuses the same factor into the copy of each fresh
        gradient into its bucket (minddp.engine.reductions), then skips this (`prescaled`)."""
        if self.average is None:
            return
        if tensor.is_sparse:
            tensor.div_(self.world)
        else:
            tensor.mul_(self.average)

    def __call__(self, tensor: torch.Tensor, prescaled: bool = False) -> torch.futures.Future:
        if not prescaled:
            self.pre_divide(tensor)
        if self._run is None:
            self._work = all_reduce_work(tensor, self.group)
            return self._work.get_future()
        if not tensor.is_cuda:
            return self._submit(torch.futures.Future(), tensor, None, None)
        stream = self._streams.setdefault(tensor.device, torch.cuda.Stream(tensor.device))
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream: the bucket's gradients are final here
        tensor.record_stream(stream)  # a temporary (a 16-bit copy) is not reused before we finish
        return self._submit(torch.futures.Future(devices=[tensor.device]), tensor, stream, ready)

    def take_work(self):
        """The Work of the native all-reduce launched last (None for the from-scratch algorithms),
        handed over once: the observer times the collective by its own end event."""
        work, self._work = self._work, None
        return work

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


def returning_future(hook):
    """`hook` as the engine runs it: what it returns must be a future (torch's check and text,
    python_comm_hook.cpp), or the engine would fail later, deep inside its wait."""
    @functools.wraps(hook)  # the hook's own name: _get_ddp_logging_data()["comm_hook"]
    def run(state, bucket):
        fut = hook(state, bucket)
        if not _compat.is_future(fut):
            kind = type(fut)
            raise RuntimeError("DDP communication hook's callback must return a torch.futures.Future "
                               f"object, but got {kind.__module__}.{kind.__qualname__}")
        return fut

    return run


def allreduce_hook(state, bucket: GradBucket) -> torch.futures.Future:
    """The default: reduce the bucket in its own dtype, in place."""
    return bucket.all_reduce(bucket.buffer())


def compressed(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What travels in 16 bits: a copy in `dtype` (the engine copies the result back into the
    full-precision buffer, so stored gradients keep their own dtype), or the buffer itself."""
    return buffer if buffer.dtype == dtype else buffer.to(dtype)


def _compress_hook(dtype: torch.dtype):
    def hook(state, bucket: GradBucket) -> torch.futures.Future:
        return bucket.all_reduce(compressed(bucket.buffer(), dtype))

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

BUILTIN_HOOKS = {None: allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}
