"""Communication hooks: how one bucket of gradients is reduced.

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

# Backends whose all-reduce implements ReduceOp.AVG natively (gloo does in torch 2.13).
_NATIVE_AVG = {"gloo", "nccl"}


def supports_native_avg(group) -> bool:
    backend = str(dist.get_backend(group))  # e.g. "gloo" or "cpu:gloo,cuda:nccl"
    names = [part.split(":")[-1] for part in backend.split(",")]
    return all(name in _NATIVE_AVG for name in names)


def all_reduce_async(
    tensor: torch.Tensor, group, reduce_op: str, native_avg: bool
) -> torch.futures.Future:
    """Start an in-place all-reduce of `tensor`.

    The future is torch's own (its value is `[tensor]`): no Python callback is
    chained here, because each one costs a GIL round trip on the comm thread.
    """
    op = dist.ReduceOp.SUM
    if reduce_op == "avg":
        if native_avg:
            op = dist.ReduceOp.AVG
        else:
            # SUM of pre-divided values: the same average, and it cannot overflow fp16.
            tensor.div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return work.get_future()


ALGORITHMS = ("native", "ring", "rs_ag", "tree", "hierarchical")


class BucketReducer:
    """Starts the all-reduce of one bucket and returns a future.

    "native" is the library's `all_reduce(async_op=True)`. The from-scratch algorithms
    of `minddp.collectives` are blocking, so they run on one worker thread, in
    submission order: buckets still go out in the same order on every rank, and
    backward keeps computing while they travel.
    """

    def __init__(self, group, reduce_op: str = "avg", algorithm: str = "native",
                 ranks_per_node: int | None = None):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.group, self.reduce_op, self.algorithm = group, reduce_op, algorithm
        self.native_avg = supports_native_avg(group)
        self._node_groups = (collectives.NodeGroups(group, ranks_per_node)
                             if algorithm == "hierarchical" else None)
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="minddp-comm")
                      if algorithm != "native" else None)

    def __call__(self, tensor: torch.Tensor) -> torch.futures.Future:
        if self._pool is None:
            return all_reduce_async(tensor, self.group, self.reduce_op, self.native_avg)
        fut = torch.futures.Future()

        def run():
            try:
                if self.algorithm == "ring":
                    collectives.ring_all_reduce(tensor, self.group, self.reduce_op)
                elif self.algorithm == "rs_ag":
                    collectives.all_reduce_via_rs_ag(tensor, self.group, self.reduce_op)
                elif self.algorithm == "tree":
                    collectives.tree_all_reduce(tensor, self.group, self.reduce_op)
                else:
                    collectives.hierarchical_all_reduce(tensor, self._node_groups, self.reduce_op)
                fut.set_result(tensor)
            except BaseException as e:  # noqa: BLE001 - surfaced by fut.wait() on the main thread
                fut.set_exception(e)

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
