"""minddp.DistributedDataParallel: torch DDP's reducer, in Python.

Life of one iteration (a forward outside `no_sync()`, then `loss.backward()`):

1. forward: broadcast buffers from the group's first rank (if asked), reset the
   per-iteration state, run the module. A forward that will not be followed by a
   synchronised backward (under `torch.no_grad()`/`inference_mode()`, or with
   `require_backward_grad_sync=False`) leaves a pending backward alone, as torch's does.
2. backward: autograd accumulates each gradient straight into its bucket's flat
   buffer (`param.grad` is a view of it). A post-accumulate hook marks the
   parameter ready; once bucket i and every bucket before it are complete,
   bucket i's all-reduce starts asynchronously, so communication overlaps the
   rest of backward. Buckets go out strictly in index order on every rank,
   whatever order autograd delivers gradients in.
3. end of backward: a callback queued on the autograd engine launches what is
   left (buckets with unused parameters, or everything when overlap=False),
   waits, and checks the usage flags carried by the last bucket. After the first
   iteration the buckets are rebuilt once in the observed gradient-ready order
   (rank 0's order, broadcast).

When `loss.backward()` returns, every `param.grad` holds the average over ranks.

The constructor takes torch DDP's arguments in torch's order (`device_ids`, `output_device`,
`dim`, `broadcast_buffers`, `init_sync`, `process_group`, `bucket_cap_mb`,
`find_unused_parameters`, ..., `device_mesh`), so `DDP(model, device_ids=[local_rank])`
from an existing script works unchanged; minddp's own options are keyword-only after them.

torch-DDP-compatible attributes a training script may set or read:
- `require_backward_grad_sync`: False makes the next forward/backward accumulate
  locally (what `no_sync()` toggles; nanoGPT and llm.c set it per micro-step);
- `require_forward_param_sync`: whether the next forward broadcasts buffers
  (set by each forward, torch's rule);
- `module`, `process_group`, `bucket_cap_mb`, `find_unused_parameters`,
  `broadcast_buffers`, `no_sync()`, `join()`, `register_comm_hook()`.
`bucket_cap_mb` means what it means in torch DDP: a bucket closes once it reaches
the cap; `None` (the default) is 25 MiB after a 1 MiB first bucket.
`strict_bucket_cap=True` is minddp's alternative: a bucket never exceeds the cap.
"""

from __future__ import annotations

import collections
import functools
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from . import _compat
from .buckets import TensorSpec, assign_buckets, bucket_limits, make_buckets
from .comm_hooks import BUILTIN_HOOKS, BucketReducer, GradBucket

_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024
# module -> weakref to the live minddp wrapper that owns its hooks (a second wrapper is an error)
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


@dataclass
class CommStats:
    """Communication of the last synchronised iteration.

    num_collectives counts the gradient-bucket reductions (one per bucket); the
    one-off broadcast of the rebuilt bucket plan after the first iteration is
    not included. comm_time_s runs from the first bucket launch to the last
    completion (under overlap it spans most of backward); busy_s is the time at least
    one bucket was in flight (the union of launch-to-completion intervals), the number
    to compare with a cost model; exposed_wait_s is how long the end-of-backward callback blocked
    waiting for communication (the part overlap did not hide).
    """

    num_buckets: int = 0
    num_collectives: int = 0
    bytes: int = 0  # on the wire: 16-bit sizes under compress=fp16/bf16
    comm_time_s: float = 0.0
    busy_s: float = 0.0
    exposed_wait_s: float = 0.0
    launched_in_backward: int = 0
    launch_order: list[int] = field(default_factory=list)
    overlap: bool = True


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper: same API shape as `torch.nn.parallel.DistributedDataParallel`."""

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,  # torch DDP's arguments, in its order, so its call sites work unchanged
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool = True,
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
        *,
        overlap: bool = True,
        reduce_op: str = "avg",
        compress: str | None = None,
        algorithm: str = "native",
        ranks_per_node: int | None = None,
        strict_bucket_cap: bool = False,
        shard_optimizer: bool = False,
    ):
        super().__init__()
        compress = None if compress in ("none", "None", "") else compress
        _check_arguments(reduce_op, compress, bucket_cap_mb)
        process_group = _torch_arguments(module, device_ids, process_group, device_mesh,
                                         delay_all_reduce_named_params, param_to_hook_all_reduce,
                                         mixed_precision)
        if shard_optimizer:
            _check_shardable(compress, algorithm, find_unused_parameters)
        _check_not_wrapped(module)

        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        # broadcast(src=...) takes a *global* rank, also for a sub-group.
        self.src_rank = dist.get_process_group_ranks(self.process_group)[0]
        self.bucket_cap_mb = bucket_cap_mb
        self.strict_bucket_cap = strict_bucket_cap
        # ZeRO-1 (minddp.zero.ShardedOptimizer): buckets are reduce-scattered, each rank
        # keeps the averaged gradient of its 1/n shard only, and parameters live in flat
        # buffers laid out like the buckets, so a shard of them can be stepped and all-gathered
        self.shard_optimizer = shard_optimizer
        self.layout_version = 0
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.overlap = overlap
        self.reduce_op = reduce_op
        self._reducer = BucketReducer(self.process_group, reduce_op, algorithm, ranks_per_node)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._module_buffers = list(module.buffers())
        first = next(module.parameters(), None)
        self._device = first.device if first is not None else torch.device("cpu")

        self._check_same_model_across_ranks()
        if init_sync:  # torch's init_sync=False: the caller guarantees equal replicas
            with torch.no_grad():
                self._broadcast_coalesced([p.detach() for p in module.parameters()])
                self._broadcast_coalesced(self._module_buffers)

        self._specs = [TensorSpec.of(p) for p in self._params]
        n = len(self._params)
        self._build_buckets(list(reversed(range(n))))
        self._rebuilt = False
        self._attach_hooks(module)
        self._comm_hook, self._comm_state = BUILTIN_HOOKS[compress], None
        self._init_iteration_state(overlap)

    def _attach_hooks(self, module: nn.Module) -> None:
        # hooks hold a weak reference: a dropped wrapper removes its hooks (finalizer)
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, me, i))
                       for i, p in enumerate(self._params)]
        self._finalizer = weakref.finalize(self, _remove_hooks, self._hooks, weakref.ref(module))
        _OWNERS[module] = me

    def _init_iteration_state(self, overlap: bool) -> None:
        self.require_backward_grad_sync = True  # False inside no_sync(); torch DDP's attribute
        self.require_forward_param_sync = True  # torch DDP's rule for buffer broadcast
        self._expect_sync = False  # this backward must reduce
        self._reduced_since_forward = False  # a second backward of one forward is an error
        self._callback_queued = False
        self._stats = CommStats(num_buckets=len(self._buckets), overlap=overlap)
        # On CUDA a collective's future completes when it is enqueued, so host clocks would
        # read ~0: per-bucket CUDA events time the work itself (read lazily, no sync per step)
        self._cuda_timing = self._device.type == "cuda"
        self._timing_stream = torch.cuda.Stream(self._device) if self._cuda_timing else None
        self._cuda_marks: dict | None = None
        # set to a list to record (event, bucket, time) tuples: see minddp.timeline
        self.trace: list | None = None
        self._join: dict | None = None  # inside join(): {"divide": bool, "iters": int, "active": int}
        self._ready_order: list[int] = []

    # ----------------------------------------------------------------- public API
    def forward(self, *args, **kwargs):
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        bcast = self.require_forward_param_sync and self.broadcast_buffers and self.world_size > 1
        src = None
        if self._join is not None:  # tell the ranks that ran out of data what this iteration does
            src = self._join_exchange(1, sync, bcast)[3]
        if bcast:
            with torch.no_grad():
                self._broadcast_coalesced(self._module_buffers, src=src)
        self.require_forward_param_sync = sync
        if torch.is_grad_enabled():  # a new graph: its backward may run (again) once
            self._reduced_since_forward = False
        if sync:
            self._prepare_for_backward()
        # otherwise a pending backward (forward, no-grad forward, backward) is left alone
        return self.module(*args, **kwargs)

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of every gradient, read from the flat bucket buffers: one kernel per bucket
        instead of one per parameter, no host sync. Valid after a synchronised backward."""
        if self.shard_optimizer:
            raise RuntimeError("with shard_optimizer each rank holds only its shard of the gradients: "
                               "use ShardedOptimizer.grad_norm() / clip_grad_norm_()")
        parts = [b.buffer[: sum(b.numels)] for b in self._buckets]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32)
                                                     for p in parts]))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the flat buffers; returns the norm before clipping."""
        total = self.grad_norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for b in self._buckets:
            b.buffer[: sum(b.numels)].mul_(coef.to(b.buffer.dtype))
        return total

    def remove_hooks(self) -> None:
        """Detach this wrapper from the module (also done when the wrapper is garbage-collected)."""
        self._finalizer()

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
    def join(self, divide_by_initial_world_size: bool = True):
        """Uneven inputs (torch's `Join`): wrap the training loop; a rank that runs out of data
        keeps shadowing the others' collectives (zeros for its gradients) until every rank is
        done, then all ranks take the parameters of the rank that finished last.

        Gradients are averaged over the initial world size (torch's default) or, with
        divide_by_initial_world_size=False, over the ranks still training.
        """
        self._join = {"divide": divide_by_initial_world_size, "iters": 0, "active": self.world_size}
        try:
            yield
        except BaseException:
            self._join = None
            raise
        try:
            self._shadow_until_all_joined()
        finally:
            self._join = None

    def _join_exchange(self, active: int, sync: bool, bcast: bool) -> tuple[int, bool, bool, int]:
        """One all-gather per forward inside join(): who still trains, does this iteration
        reduce gradients, does it broadcast buffers, and from whom (as torch's Join: the
        highest rank still training, since the first rank may have run out of data)."""
        mine = torch.tensor([active, int(sync), int(bcast)], dtype=torch.int64, device=self._device)
        every = torch.empty(self.world_size * 3, dtype=torch.int64, device=self._device)
        _compat.all_gather_single(every, mine, group=self.process_group)
        every = every.view(self.world_size, 3)
        ranks = dist.get_process_group_ranks(self.process_group)
        alive = [ranks[i] for i, a in enumerate(every[:, 0].tolist()) if a]
        self._join["active"] = len(alive)
        if active:
            self._join["iters"] += 1
        return len(alive), bool(every[:, 1].any()), bool(every[:, 2].any()), max(alive, default=-1)

    def _shadow_until_all_joined(self) -> None:
        while True:
            active, sync, bcast, src = self._join_exchange(0, False, False)
            if active == 0:
                break
            if bcast:
                with torch.no_grad():
                    self._broadcast_coalesced(self._module_buffers, src=src)
            if sync:  # the others reduce their gradients now: take part with zeros, in order
                futures = []
                for gb in self._grad_buckets:
                    zeros = torch.zeros_like(gb.buffer())
                    view = GradBucket(gb.index(), zeros, gb.parameters(), [], gb.is_last(), self._reducer)
                    futures.append(self._comm_hook(self._comm_state, view))
                for f in futures:
                    f.wait()
                if not self._rebuilt:  # the others rebuild after their first iteration
                    self._ready_order = []
                    self._rebuild_in_ready_order()
        # everyone is done: the rank that trained longest (ties: the highest rank) has the
        # model the others must take, as torch's Join does
        me = dist.get_process_group_ranks(self.process_group).index(dist.get_rank())
        key = torch.tensor([self._join["iters"] * self.world_size + me], device=self._device)
        dist.all_reduce(key, op=dist.ReduceOp.MAX, group=self.process_group)
        last = dist.get_process_group_ranks(self.process_group)[int(key.item()) % self.world_size]
        with torch.no_grad():
            self._broadcast_coalesced([p.detach() for p in self.module.parameters()], src=last)
            self._broadcast_coalesced(self._module_buffers, src=last)

    def register_comm_hook(self, state, hook) -> None:
        """Replace how buckets are reduced: `hook(state, GradBucket) -> Future`."""
        self._comm_state, self._comm_hook = state, hook

    @property
    def bucket_assignment(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names[i] for i in b.param_ids] for b in self._buckets]

    # -------------------------------------------------------------- construction
    def _check_same_model_across_ranks(self) -> None:
        """Every rank must hold the same tensors, or the broadcasts below would hang."""
        mine = [("parameter", n, tuple(p.shape), str(p.dtype))
                for n, p in self.module.named_parameters()]
        mine += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in self.module.named_buffers()]
        mine += [("requires_grad", tuple(self._names))]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        ranks = dist.get_process_group_ranks(self.process_group)
        ref = everyone[0]
        for r, sig in zip(ranks[1:], everyone[1:]):
            if sig == ref:
                continue
            for k in range(max(len(ref), len(sig))):
                a = ref[k] if k < len(ref) else "nothing"
                b = sig[k] if k < len(sig) else "nothing"
                if a != b:
                    raise RuntimeError(
                        "minddp.DistributedDataParallel: the model differs across ranks. "
                        f"Entry #{k}: rank {ranks[0]} has {_describe(a)} but rank {r} has "
                        f"{_describe(b)}. Build the same model (same config, same code path) "
                        "on every rank before wrapping it."
                    )

    def _broadcast_coalesced(self, tensors: list[torch.Tensor], src: int | None = None) -> None:
        """Broadcast from `src` (default the group's first rank), one flat tensor per dtype/device chunk."""
        if self.world_size == 1 or not tensors:
            return
        src = self.src_rank if src is None else src
        groups: dict[tuple, list[list[torch.Tensor]]] = {}
        for t in tensors:
            chunks = groups.setdefault((t.dtype, t.device), [[]])
            if chunks[-1] and sum(x.nbytes for x in chunks[-1]) + t.nbytes > _BROADCAST_CHUNK_BYTES:
                chunks.append([])
            chunks[-1].append(t)
        is_src = dist.get_rank() == src
        for chunks in groups.values():
            for chunk in chunks:
                flat = _compat.flatten_dense_tensors(chunk)
                dist.broadcast(flat, src=src, group=self.process_group)
                if not is_src:
                    for t, v in zip(chunk, _compat.unflatten_dense_tensors(flat, chunk)):
                        t.copy_(v)

    def _build_buckets(self, order: list[int]) -> None:
        """(Re)allocate flat buffers for `order`; existing gradients move into them."""
        assignment = assign_buckets(self._specs, order, self.bucket_cap_mb, strict=self.strict_bucket_cap)
        pad = self.world_size if self.shard_optimizer else 1
        self._buckets = make_buckets(self._params, assignment, tail_numel=len(self._params), pad_to=pad)
        self.layout_version += 1
        self._views: list[torch.Tensor] = [None] * len(self._params)
        self._where: list[tuple[int, int]] = [None] * len(self._params)
        for b in self._buckets:
            for k, i in enumerate(b.param_ids):
                p = self._params[i]
                view = b.view(k, p.shape)
                self._views[i], self._where[i] = view, (b.index, k)
                if p.grad is not None:
                    view.copy_(p.grad)
                    p.grad = view
        if self.shard_optimizer:
            self._flatten_params()
        last = len(self._buckets) - 1
        self._grad_buckets = [  # what comm hooks see; built once per bucket layout
            GradBucket(b.index, b.buffer, [self._params[i] for i in b.param_ids],
                       [self._views[i] for i in b.param_ids], b.index == last, self._reducer)
            for b in self._buckets]

    def _flatten_params(self) -> None:
        """Parameters become views of flat buffers laid out like the gradient buckets."""
        self.flat_params = []
        with torch.no_grad():
            for b in self._buckets:
                flat = torch.zeros_like(b.buffer)
                for k, i in enumerate(b.param_ids):
                    p = self._params[i]
                    view = flat[b.offsets[k] : b.offsets[k] + b.numels[k]].view(p.shape)
                    view.copy_(p)
                    p.data = view
                self.flat_params.append(flat)

    def shard_range(self, b: int) -> tuple[int, int]:
        """[lo, hi) of bucket b's buffer that this rank owns under shard_optimizer."""
        per = self._buckets[b].buffer.numel() // self.world_size
        me = dist.get_group_rank(self.process_group, dist.get_rank())
        return me * per, (me + 1) * per

    # ------------------------------------------------------------------ backward
    def _prepare_for_backward(self) -> None:
        self._expect_sync = True
        self._callback_queued = False
        self._ready = [False] * len(self._params)
        self._ready_order: list[int] = []
        self._next_bucket = 0
        self._t_first_launch = self._t_last_done = None
        self._inflight: collections.deque[int] = collections.deque()
        for b in self._buckets:
            b.pending, b.future, b.unused, b.t_done = len(b.param_ids), None, [], None
        self._stats = CommStats(num_buckets=len(self._buckets), overlap=self.overlap)
        self._cuda_marks = None

    def _on_grad_ready(self, i: int, p: torch.Tensor) -> None:
        view, grad = self._views[i], p.grad
        if grad is not view and grad.data_ptr() != view.data_ptr():
            # .grad was None (e.g. after zero_grad(set_to_none=True)), so autograd
            # allocated a fresh tensor: move it into the bucket.
            if grad.is_sparse:
                raise RuntimeError(
                    f"minddp: parameter {self._names[i]!r} has a sparse gradient (e.g. "
                    "nn.Embedding(sparse=True)); minddp reduces dense buckets only: use sparse=False")
            view.copy_(grad)
            p.grad = view
        if not self._expect_sync:
            if self._reduced_since_forward:
                raise RuntimeError(
                    "minddp: backward ran again after this forward's gradients were already "
                    "reduced; run a forward before each backward, or accumulate under no_sync()")
            return
        if not self._callback_queued:
            self._callback_queued = True
            _compat.queue_autograd_callback(self._finish_backward)
        if self._ready[i]:
            raise RuntimeError(
                f"minddp: parameter {self._names[i]!r} received a gradient twice in one "
                "iteration. Call backward once per forward, or accumulate under no_sync()."
            )
        self._ready[i] = True
        self._ready_order.append(i)
        bucket = self._buckets[self._where[i][0]]
        bucket.pending -= 1
        if bucket.pending == 0 and self.overlap:
            self._launch_complete_buckets()
        if self._inflight:
            self._poll_done()

    def _launch_complete_buckets(self) -> None:
        # Strictly in index order: bucket i never goes out before bucket i-1.
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        for i in bucket.param_ids:
            if not self._ready[i]:  # unused this iteration: contribute what .grad holds, or zeros
                p, view = self._params[i], self._views[i]
                bucket.unused.append((i, p.grad is None))
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
        if b == len(self._buckets) - 1:
            # Usage flags travel in the last bucket's tail, so every rank learns which
            # parameters some rank left unused, at no extra collective. The flag is
            # "unused here" (or "used here" with find_unused_parameters): after a
            # sum or average, nonzero means "on some rank", in any dtype.
            flags = torch.tensor(
                [r == self.find_unused_parameters for r in self._ready],
                dtype=bucket.buffer.dtype,
            )
            bucket.buffer[-len(self._params):].copy_(flags)
        now = time.perf_counter()
        if self._t_first_launch is None:
            self._t_first_launch = now
        bucket.t_launch = now
        if self.trace is not None:
            self.trace.append(("launch", b, now))
        if _compat.profiler_enabled():  # a named range in torch.profiler traces
            kind = "reduce_scatter" if self.shard_optimizer else "all_reduce"
            with torch.profiler.record_function(f"minddp: bucket {b} {kind} ({bucket.grad_nbytes} B)"):
                bucket.future = self._start_collective(b)
        else:
            bucket.future = self._start_collective(b)
        if isinstance(bucket.future, torch.futures.Future) and not self._cuda_timing:
            # the completion time, exactly (busy_s): a callback on the comm thread. (On CUDA the
            # future completes at enqueue and CUDA events time the work instead.)
            bucket.future = bucket.future.then(functools.partial(self._on_done, b))
        else:  # a Work without a future (gloo's reduce-scatter): completion seen by polling
            self._inflight.append(b)
        if self._cuda_timing:
            start, end = bucket.cuda_events
            start.record()  # on the compute stream: the bucket is handed to the backend here
            with torch.cuda.stream(self._timing_stream):
                bucket.future.wait()  # the timing stream waits for the collective, the host does not
                end.record()
        self._stats.launch_order.append(b)

    def _start_collective(self, b: int):
        """The bucket's asynchronous reduction: a Future (a comm hook's) or a Work wrapper."""
        bucket = self._buckets[b]
        if self.shard_optimizer:  # reduce-scatter: this rank's shard of the average, in place
            lo, hi = self.shard_range(b)
            op = dist.ReduceOp.AVG if self.reduce_op == "avg" else dist.ReduceOp.SUM
            return _WorkFuture(_compat.reduce_scatter_single(
                bucket.buffer[lo:hi], bucket.buffer, op=op, group=self.process_group, async_op=True))
        return self._comm_hook(self._comm_state, self._grad_buckets[b])

    def _poll_done(self) -> None:
        """Note the completion time of launched buckets that have finished (in launch order)."""
        while self._inflight and self._buckets[self._inflight[0]].future.done():
            self._mark_done(self._inflight.popleft())

    def _on_done(self, b: int, fut):
        self._mark_done(b)
        return fut.value()

    def _mark_done(self, b: int) -> None:
        self._t_last_done = self._buckets[b].t_done = time.perf_counter()
        if self.trace is not None:
            self.trace.append(("done", b, self._t_last_done))

    def _finish_backward(self) -> None:
        """Runs once at the end of a synchronised backward (queued on the autograd engine)."""
        self._stats.launched_in_backward = self._next_bucket
        self._reduced_since_forward = True
        t_wait = time.perf_counter()
        if self.trace is not None:
            self.trace.append(("backward_end", None, t_wait))
        if self._cuda_timing:
            self._cuda_marks = {"backward_end": torch.cuda.Event(enable_timing=True),
                                "wait_end": torch.cuda.Event(enable_timing=True)}
            self._cuda_marks["backward_end"].record()
        self._expect_sync = False
        for b in range(self._next_bucket, len(self._buckets)):
            self._launch(b)
        self._next_bucket = len(self._buckets)
        if _compat.profiler_enabled():
            with torch.profiler.record_function("minddp: wait for buckets"):
                wire_bytes = self._wait_buckets()
        else:
            wire_bytes = self._wait_buckets()
        self._record_stats(t_wait, wire_bytes)
        if self.shard_optimizer:
            self._check_used_here()  # each rank only holds its shard of the usage flags
        elif not self.find_unused_parameters and self._cuda_timing and all(self._ready):
            pass  # on CUDA reading the flags is a host sync: a rank that left a parameter unused reads them
        else:
            self._check_usage_flags()
        if not self._rebuilt:
            self._rebuild_in_ready_order()

    def _wait_buckets(self) -> int:
        """Wait for every bucket in order, copy results into the buffers; returns wire bytes."""
        rescale = (self.world_size / self._join["active"] if self._join and not self._join["divide"]
                   and self.reduce_op == "avg" and self._join["active"] < self.world_size else None)
        wire_bytes = 0
        for b, bucket in enumerate(self._buckets):
            result = bucket.future.wait()
            if self._inflight and self._inflight[0] == b:  # not seen finished by a poll: now
                self._inflight.popleft()
                self._mark_done(b)
            if isinstance(result, list):  # torch's collectives give [tensor]
                result = result[0]
            bucket.future = None  # nothing outlives the step (a Work holds its tensors)
            if self.shard_optimizer:  # in place: the shard already holds its averaged gradient
                wire_bytes += bucket.buffer.numel() * bucket.buffer.element_size()
                continue
            wire_bytes += result.numel() * result.element_size()
            if result.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(result)
            if rescale:  # averaged over the ranks still training, not the initial world
                bucket.buffer.mul_(rescale)
        return wire_bytes

    def _record_stats(self, t_wait: float, wire_bytes: int) -> None:
        done = time.perf_counter()
        if self.trace is not None:
            self.trace.append(("wait_end", None, done))
        if self._cuda_timing:
            self._cuda_marks["wait_end"].record()  # after the compute stream waited for every bucket
        stats = self._stats
        stats.exposed_wait_s = done - t_wait
        stats.comm_time_s = (self._t_last_done or done) - self._t_first_launch
        stats.busy_s = _union_length([(b.t_launch, b.t_done or done) for b in self._buckets])
        stats.num_collectives = len(self._buckets)
        stats.bytes = wire_bytes

    @property
    def comm_stats(self) -> CommStats:
        """The last synchronised iteration's communication (CUDA events resolved on first read)."""
        if self._cuda_marks is not None:
            self._resolve_cuda_timing()
        return self._stats

    def _resolve_cuda_timing(self) -> None:
        marks, self._cuda_marks = self._cuda_marks, None
        marks["wait_end"].synchronize()
        ref = self._buckets[0].cuda_events[0]
        ms = lambda ev: ref.elapsed_time(ev) / 1e3  # noqa: E731 - seconds since the first launch
        spans = [(ms(b.cuda_events[0]), ms(b.cuda_events[1])) for b in self._buckets]
        s = self._stats
        s.busy_s = _union_length(spans)
        s.comm_time_s = max(e for _, e in spans) - min(b for b, _ in spans)
        s.exposed_wait_s = max(0.0, ms(marks["wait_end"]) - ms(marks["backward_end"]))

    def _check_used_here(self) -> None:
        here = [self._names[i] for i, r in enumerate(self._ready) if not r]
        if here:
            raise RuntimeError(
                f"minddp: {len(here)} parameter(s) received no gradient on this rank: {here}. With "
                "shard_optimizer every parameter must take part in the loss on every rank (or be frozen "
                "with requires_grad_(False)).")

    def _check_usage_flags(self) -> None:
        flags = self._buckets[-1].buffer[-len(self._params):] != 0
        if self.find_unused_parameters:
            for bucket in self._buckets:
                for i, grad_was_none in bucket.unused:
                    # globally used: .grad is the averaged view; globally unused: untouched
                    if flags[i]:
                        self._params[i].grad = self._views[i]
                    elif grad_was_none:
                        self._params[i].grad = None
        elif flags.any():
            names = [self._names[i] for i in flags.nonzero().flatten().tolist()]
            here = [self._names[i] for i, r in enumerate(self._ready) if not r]
            raise RuntimeError(
                f"minddp: {len(names)} parameter(s) received no gradient on at least one rank "
                f"in this iteration: {names} (on this rank: {here}). Every rank stopped here. "
                "Fix: make these parameters take part in the loss on every rank, freeze them "
                "with requires_grad_(False) if they are not trained, or wrap the model with "
                "find_unused_parameters=True."
            )

    def _rebuild_in_ready_order(self) -> None:
        """Once: re-bucket by rank 0's observed gradient-ready order (broadcast)."""
        self._rebuilt = True
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in reversed(range(len(self._params))) if i not in seen]
        device = self._buckets[0].buffer.device if self._buckets else torch.device("cpu")
        plan = torch.tensor(order, dtype=torch.int64, device=device)
        dist.broadcast(plan, src=self.src_rank, group=self.process_group)
        order = plan.tolist()
        current = [i for b in self._buckets for i in b.param_ids]
        if order != current:
            self._build_buckets(order)
            self._stats.num_buckets = len(self._buckets)


class _WorkFuture:
    """A Work seen as the engine's futures are (gloo's reduce-scatter has no get_future())."""

    def __init__(self, work):
        self.work = work

    def done(self) -> bool:
        return self.work.is_completed()

    def wait(self):
        self.work.wait()  # on CUDA: the current stream waits, the host does not
        return None


def _hook(owner: weakref.ref, i: int, p: torch.Tensor) -> None:
    ddp = owner()
    if ddp is not None:
        ddp._on_grad_ready(i, p)


def _remove_hooks(handles, module_ref) -> None:
    for h in handles:
        h.remove()
    module = module_ref()
    if module is not None:
        _OWNERS.pop(module, None)


def _check_arguments(reduce_op, compress, bucket_cap_mb) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "minddp.DistributedDataParallel needs an initialised process group: "
            "call minddp.init_distributed() (or torch.distributed.init_process_group) first"
        )
    if reduce_op not in ("avg", "sum"):
        raise ValueError(f"reduce_op must be 'avg' or 'sum', got {reduce_op!r}")
    if compress not in BUILTIN_HOOKS:
        raise ValueError(f"compress must be None, 'fp16' or 'bf16', got {compress!r}")
    bucket_limits(bucket_cap_mb)  # raises on a non-positive cap


def _torch_arguments(module, device_ids, process_group, device_mesh, delay_all_reduce_named_params,
                     param_to_hook_all_reduce, mixed_precision):
    """torch DDP's constructor arguments: the ones that matter for a single-device module are
    honoured or checked as torch does; the features minddp lacks are refused by name.
    (`output_device`, `dim`, `check_reduction`, `gradient_as_bucket_view` and `static_graph`
    change nothing here: gradients are always bucket views, buckets are rebuilt once.)"""
    for name, value in (("delay_all_reduce_named_params", delay_all_reduce_named_params),
                        ("param_to_hook_all_reduce", param_to_hook_all_reduce),
                        ("mixed_precision", mixed_precision)):
        if value is not None:
            raise NotImplementedError(f"minddp.DistributedDataParallel does not implement torch DDP's "
                                      f"{name}; use torch.autocast for mixed precision, or torch DDP")
    if device_mesh is not None:
        if process_group is not None:
            raise RuntimeError("pass process_group or device_mesh, not both (as torch DDP)")
        process_group = device_mesh.get_group()
    devices = {p.device for p in module.parameters()}
    if device_ids is not None and (len(devices) != 1 or next(iter(devices)).type == "cpu"):
        raise ValueError(f"device_ids={device_ids} only works with a single-device GPU module (torch DDP's "
                         f"rule); this module's parameters are on {sorted(map(str, devices))}: pass "
                         "device_ids=None")
    if device_ids is not None:
        want = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else None
        index = device_ids[0] if isinstance(device_ids[0], int) else want.index
        if len(device_ids) != 1 or next(iter(devices)).index != index:
            raise ValueError(f"device_ids={device_ids}: the module is on {next(iter(devices))}; give "
                             "exactly the one device it lives on (move it with .to(device) first)")
    return process_group


def _check_shardable(compress, algorithm, find_unused_parameters) -> None:
    if compress not in (None, "none", "None", ""):
        raise ValueError(f"shard_optimizer does not combine with compress={compress!r}: the shards are "
                         "reduce-scattered in the gradients' own dtype; drop one of the two")
    if algorithm != "native":
        raise ValueError(f"shard_optimizer uses the backend's reduce-scatter; algorithm={algorithm!r} "
                         "only implements all-reduce: use algorithm='native'")
    if find_unused_parameters:
        raise ValueError("shard_optimizer does not support find_unused_parameters=True: freeze "
                         "unused parameters with requires_grad_(False) instead")


def _check_not_wrapped(module: nn.Module) -> None:
    if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
        raise TypeError(f"minddp.DistributedDataParallel: the module is already a {type(module).__name__}; "
                        "wrap the plain model once (pass `ddp.module` to wrap it anew)")
    owner = _OWNERS.get(module)
    if owner is not None and owner() is not None:
        raise RuntimeError(
            "minddp.DistributedDataParallel: this module is already wrapped by another live minddp "
            "DDP, whose hooks would fight over .grad. Wrap it once, or call old.remove_hooks() "
            "(or drop the old wrapper) first.")


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _describe(entry) -> str:
    if entry == "nothing":
        return "no further tensor"
    if entry[0] == "requires_grad":
        return f"trainable parameters {list(entry[1])}"
    kind, name, shape, dtype = entry
    return f"{kind} {name!r} of shape {list(shape)} and dtype {dtype}"


DDP = DistributedDataParallel
