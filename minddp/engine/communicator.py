"""How one tensor is all-reduced over the engine's group: `Communicator`.

The engine's averaging rule (`pre_divide`: x * 1/n before a SUM, torch DDP's) and its algorithm:
the backend's own all-reduce ("native"), or one of minddp.comm.collectives' from-scratch ones (a
table, `ALGORITHMS`). A call starts the collective and returns what it started (`Started`: the
future to wait on and, for the backend's own, its Work), so nothing is handed over on the side.
How a *bucket* is reduced (all-reduce, compressed, a comm hook, ZeRO-1's reduce-scatter) is
minddp.engine.reductions'; torch-style hooks are minddp.engine.comm_hooks'.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..comm import collectives


def all_reduce_work(tensor: torch.Tensor, group) -> dist.Work:
    """Start an in-place SUM all-reduce of `tensor` (the average's 1/n applied before it, by
    `Communicator.pre_divide`) and return the Work, whose wait() orders the waiting CUDA stream
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


class Started(NamedTuple):
    """A collective that was started, as its starter returns it: what to wait on (a future, or
    a Work-like with done()/wait(): ZeRO-1's reduce-scatter) and the backend's own Work when the
    backend ran it (None for the from-scratch algorithms and hooks): the CUDA observer orders its
    timing stream after that Work's end event."""

    future: object
    work: object = None


class Communicator:
    """Starts the all-reduce of one bucket with the engine's group and averaging rule, and
    returns what it started (`Started`).

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

    def pre_divide(self, tensor: torch.Tensor) -> None:
        """torch DDP's average, applied before a SUM: x * (1/n) (a sparse gradient x / n, as
        torch's reducer). Never ReduceOp.AVG: NCCL runs float AVG as PreMulSum, which rules out
        NVLS on NVSwitch machines and sums in another order than torch DDP; dividing first also
        keeps fp16 from overflowing. Every reduction of a bucket goes through here, once per
        bucket; mixed precision alone divides after its sum (`sum_only`), as torch's hook."""
        if self.average is None:
            return
        if tensor.is_sparse:
            tensor.div_(self.world)
        else:
            tensor.mul_(self.average)

    def __call__(self, tensor: torch.Tensor, sum_only: bool = False) -> Started:
        if not sum_only:
            self.pre_divide(tensor)
        if self._run is None:
            work = all_reduce_work(tensor, self.group)
            return Started(work.get_future(), work)
        if not tensor.is_cuda:
            return Started(self._submit(torch.futures.Future(), tensor, None, None))
        stream = self._streams.setdefault(tensor.device, torch.cuda.Stream(tensor.device))
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream: the bucket's gradients are final here
        tensor.record_stream(stream)  # a temporary (a 16-bit copy) is not reused before we finish
        return Started(self._submit(torch.futures.Future(devices=[tensor.device]), tensor, stream, ready))

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
