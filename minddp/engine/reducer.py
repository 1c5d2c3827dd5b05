"""The reducer: one object that owns the buckets and one iteration, in torch's reducer's phases.

    prepare_for_backward()   a synchronised forward starts an iteration: every flag below is reset
    watch(output)            ... and says where its backward ends (prehooks on the output's nodes)
    autograd_hook(i)         parameter i's gradient was accumulated: mark it ready (its bucket view)
    launch ready buckets     bucket b goes out once it and every bucket before it are complete:
                             strictly in index order on every rank, whatever order autograd uses
    finalize()               queued once on the autograd engine; launches what is left, waits for
                             every bucket in order: then every .grad is the average over ranks

The rules, each a flag named for the torch rule it encodes (torch's `reducer.cpp`):
- `expect_autograd_hooks` (torch's name): only a synchronised forward (grad enabled, outside
  `no_sync()`) starts an iteration; a hook outside one (no_sync, a backward through the plain
  module, a second backward of a retained graph) just leaves the local gradient in .grad.
- `finalize_queued`: the end-of-backward callback is queued once per iteration, on the backward
  of the graph this forward built: by a prehook on the forward's output nodes (that backward,
  not a reentrant checkpoint's nested recomputation), or when the last bucket is launched
  (torch's own rule, whichever graph task that is), or at the first hook when the output
  carries no graph.
- `static_graph`: a parameter may be ready more than once (weight sharing, checkpointed twice):
  the first iteration counts each parameter's hooks and reduces everything at its end (torch's
  delayed all-reduce); later iterations mark a parameter ready at its last hook.
- `require_finalize`: a parameter was marked ready, so the iteration must be finalized before the
  next one starts (torch's "Expected to have finished reduction in the prior iteration").

How a bucket is reduced is `reduction`'s (minddp.engine.reductions), what is recorded the
`observer`'s, the usage flags `usage`'s; where each gradient lives is `layout` (a public map).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .. import _compat
from .buckets import Layout, TensorSpec, assign_buckets
from .comm_hooks import BucketReducer
from .observer import observer_for
from .reductions import make_reduction
from .usage import UsageFlags

# torch's texts (reducer.cpp), so scripts that match them keep working
MARKED_TWICE = ("Expected to mark a variable ready only once. This error is caused by one of the following "
                "reasons: 1) Use of a module parameter outside the `forward` function. ... 2) Reused "
                "parameters in multiple reentrant backward passes (activation checkpointing twice, or "
                "weight sharing under checkpoint): pass static_graph=True if the graph is the same every "
                "iteration.")
GRAPH_CHANGED = ("Your training graph has changed in this iteration, e.g., one parameter is unused in first "
                 "iteration, but then got used in the second iteration. this is not compatible with "
                 "static_graph set to True.")
NOT_FINISHED = ("Expected to have finished reduction in the prior iteration before starting a new one. This "
                "error indicates that your module has parameters that were not used in producing loss, or "
                "that the loss was not computed from the wrapper's output: pass find_unused_parameters=True, "
                "or compute the loss from every forward's output.")


class Reducer:
    """Owns the buckets and the iteration of one DistributedDataParallel (see the module doc)."""

    def __init__(self, params, names, group, device, options: dict, sparse: list[bool]):
        self.params, self.names, self.group, self.device = params, names, group, device
        self.world_size = dist.get_world_size(group)
        self.src_rank = dist.get_process_group_ranks(group)[0]  # global (broadcast's src)
        self.options = options  # bucket caps, find_unused_parameters, static_graph, overlap, ...
        self.static_graph = options["static_graph"]
        self.find_unused = options["find_unused_parameters"]
        self.overlap = options["overlap"]
        self.skip_unused = options["skip_all_reduce_unused_params"] and self.find_unused
        self.sparse = sparse  # torch's expect_sparse_gradient: its own bucket, reduced as it is
        if any(sparse):
            _check_sparse_options(options, [n for n, s in zip(names, sparse) if s])
        reducer = BucketReducer(group, options["reduce_op"], options["algorithm"], options["ranks_per_node"])
        self.reduction = make_reduction(reducer, options["compress"], options["shard_optimizer"], params)
        self.observer = observer_for(device, self.overlap)
        # static_graph tolerates unused parameters as find_unused_parameters does (torch's rule)
        self.usage = UsageFlags(names, self.find_unused or self.static_graph)
        self.reduced_callbacks, self.rebuild_callbacks = [], []  # on_reduced(fn), on_rebuild(fn)
        self.uneven = None  # inside join(): minddp.engine.join.Join
        self.hook_registered = False
        self.rebuilt = False  # the buckets are rebuilt once, after the first iteration
        self.hook_counts: list[int] | None = None  # static_graph: hooks per parameter, 1st iteration
        self.layout: Layout | None = None
        self.expect_autograd_hooks = self.finalize_queued = self.require_finalize = False
        self.watched_outputs = self.counting = False
        self.hooks_left: list[int] | None = None  # static_graph: hooks still to come, per parameter

    # ------------------------------------------------------------------ the buckets
    def build_layout(self, order: list[int]) -> None:
        """(Re)allocate the flat buffers for `order`; existing gradients move into them. Dense
        buckets by torch's size rule, then one bucket per sparse parameter."""
        specs = [TensorSpec.of(p) for p in self.params]
        dense = [i for i in order if not self.sparse[i]]
        assignment = assign_buckets(specs, dense, self.options["bucket_cap_mb"],
                                    strict=self.options["strict_bucket_cap"],
                                    caps_mb=self.options["bucket_cap_mb_list"]) if dense else []
        assignment += [[i] for i in order if self.sparse[i]]
        version = self.layout.version + 1 if self.layout is not None else 1
        for fn in self.rebuild_callbacks:  # e.g. a sharded optimizer drops its views of the old buffers
            fn(self.layout)
        self.layout = None
        self.reduction.bind(None)  # let each old buffer go once its last gradient has moved
        shards = self.reduction.pad_to
        me = dist.get_group_rank(self.group, dist.get_rank()) if shards > 1 else 0
        self.layout = Layout(self.params, assignment, tail_numel=len(self.params), shards=shards,
                             shard_index=me, version=version, sparse=self.sparse)
        self.reduction.bind(self.layout)
        self.observer.layout_changed(len(self.layout.buckets))

    def rebuild(self, ready_order: list[int]) -> None:
        """Once: re-bucket by rank 0's observed gradient-ready order (broadcast: a collective)."""
        self.rebuilt = True
        seen = set(ready_order)
        order = list(ready_order) + [i for i in reversed(range(len(self.params))) if i not in seen]
        dense = [b.buffer for b in self.layout.buckets if not b.sparse]
        plan = torch.tensor(order, dtype=torch.int64, device=dense[0].device if dense else self.device)
        dist.broadcast(plan, src=self.src_rank, group=self.group)
        order = plan.tolist()
        if order != self.layout.order():
            self.build_layout(order)

    def register_comm_hook(self, state, hook) -> None:
        if self.hook_registered:  # torch's text (reducer.cpp, register_comm_hook)
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self.hook_registered = True
        self.reduction = self.reduction.with_hook(state, hook)
        self.reduction.bind(self.layout)

    # ------------------------------------------------------------------ phase 1: prepare
    def prepare_for_backward(self) -> bool:
        """A synchronised forward: a new iteration (torch's prepare_for_backward). Not when the
        forward is a non-reentrant checkpoint's recomputation inside this iteration's backward:
        the iteration goes on (returns False)."""
        if self.expect_autograd_hooks and _compat.in_backward():
            return False
        if self.require_finalize:  # the last iteration marked gradients ready but never finished
            self.require_finalize = False
            raise RuntimeError(NOT_FINISHED)
        self.expect_autograd_hooks = True
        self.finalize_queued = self.watched_outputs = False
        self.ready = [False] * len(self.params)
        self.ready_order: list[int] = []
        self.next_bucket = 0
        counts = self.hook_counts
        self.hooks_left = list(counts) if counts is not None else None
        self.counting = self.first_iteration_of_static_graph  # hooks counted, all reduced at the end
        self.first_counts = [0] * len(self.params) if self.counting else None
        self.marked = [False] * len(self.params)
        self.hooks_seen = False  # a backward that marks nothing (autograd.grad w.r.t. an input) ends nothing
        for b in self.layout.buckets:
            # static_graph after its first iteration: a parameter no hook reached then never comes
            b.pending = sum(1 for i in b.param_ids if counts is None or counts[i] > 0)
            b.future, b.unused = None, []
        self.complete = sum(1 for b in self.layout.buckets if b.pending == 0)  # buckets with every gradient
        self.observer.start(len(self.layout.buckets))
        return True

    def watch(self, output) -> None:
        """Queue the finalize when the backward of this forward's graph reaches its output (torch's
        _DDPSink, without a node of its own): that backward, not a nested recomputation's, ends
        the iteration. Only while this iteration is open; nothing is kept but the prehook."""
        for t in _compat.output_tensors(output):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(_OutputReached(self))
                self.watched_outputs = True

    def output_reached(self) -> None:
        if self.expect_autograd_hooks:
            self._queue_finalize()

    def _queue_finalize(self) -> None:
        if not self.finalize_queued:
            self.finalize_queued = True
            _compat.queue_autograd_callback(self.finalize)

    @property
    def first_iteration_of_static_graph(self) -> bool:
        return self.static_graph and self.hook_counts is None

    # ------------------------------------------------------------------ phase 2: mark ready
    def autograd_hook(self, i: int, p: torch.Tensor) -> None:
        """Parameter i's gradient was accumulated (a post-accumulate-grad hook)."""
        grad = p.grad
        if self.sparse[i]:
            return self._sparse_hook(i, grad)
        view = self.layout.views[i]
        if grad is not view and (grad is None or grad.data_ptr() != view.data_ptr()):
            if grad is None:  # undefined (a backward returned None): zeros, as torch's reducer
                self._undefined_grad(p, view)
            else:  # a fresh tensor (.grad was None): into the bucket, the average's 1/n fused
                last = self.expect_autograd_hooks and not self.counting and (
                    self.hooks_left is None or self.hooks_left[i] == 1)  # this hook makes it ready
                self.reduction.copy_in(i, view, grad, last)
                p.grad = view
        if not self.expect_autograd_hooks:  # outside an iteration: a local gradient, as torch
            if grad is not None and self.find_unused:  # used in a no_sync() micro-step
                self.usage.used_unsynced[i] = True
            return
        self._mark_ready(i, grad is not None or not self.find_unused)  # undefined: not a use

    def _sparse_hook(self, i: int, grad) -> None:
        if self.expect_autograd_hooks:
            self._mark_ready(i, grad is not None)

    def _mark_ready(self, i: int, used: bool) -> None:
        self.hooks_seen = True
        if not self.watched_outputs:  # no output node to wait for: end at this backward's end
            self._queue_finalize()
        if self.counting:  # static_graph's first iteration: count only, all reduced at the end
            if not self.first_counts[i]:
                self.ready_order.append(i)
            self.first_counts[i] += 1
            self.ready[i] = self.ready[i] or used
            return
        if self.hooks_left is not None:
            if self.hooks_left[i] <= 0:
                raise RuntimeError(GRAPH_CHANGED)
            self.hooks_left[i] -= 1
            if self.hooks_left[i]:
                return  # more hooks will come for this parameter (weight sharing)
        if self.marked[i]:
            raise RuntimeError(f"{MARKED_TWICE} Parameter: {self.names[i]!r}.")
        self.marked[i] = True
        self.require_finalize = True
        self.ready[i] = used
        self.ready_order.append(i)
        bucket = self.layout.buckets[self.layout.bucket_of(i)]
        bucket.pending -= 1
        self.complete += bucket.pending == 0
        self._launch_ready()

    # ------------------------------------------------------------------ phase 3: launch in order
    def _launch_ready(self) -> None:
        """Strictly in index order: bucket i never goes out before bucket i-1."""
        buckets = self.layout.buckets
        while self.overlap and self.next_bucket < len(buckets) and buckets[self.next_bucket].pending == 0:
            self._launch(self.next_bucket)
            self.next_bucket += 1
        if self.complete == len(buckets):  # torch's rule: every bucket is ready (out, with overlap)
            self._queue_finalize()
        self.observer.poll()

    def _launch(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        if bucket.sparse:
            return self._launch_sparse(b, bucket)
        for i in bucket.param_ids:
            if not self.ready[i]:  # unused this iteration: contribute what .grad holds, or zeros
                p, view = self.params[i], self.layout.views[i]
                bucket.unused.append((i, p.grad is None))
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
        flags = self.layout.flags(len(self.params)) if b == self.layout.flags_bucket else None
        if flags is not None:
            ready = [r or s for r, s in zip(self.ready, self.sparse)]  # a sparse gradient is always used
            self.usage.write(flags, ready)  # minddp.engine.usage
        self.observer.launch(b, bucket.grad_nbytes, self.reduction.kind)
        if self.skip_unused and self.usage.unused_here(bucket):  # the flags only
            future = _Skipped(self.reduction.reducer(flags) if flags is not None else None)
        else:
            future = self.reduction.launch(b)
        bucket.future = self.observer.launched(b, future, self.reduction.take_work())

    def _launch_sparse(self, b: int, bucket) -> None:
        i = bucket.param_ids[0]
        p = self.params[i]
        if p.grad is None:  # torch's text (mark_variable_ready_sparse)
            raise RuntimeError(f"Expected sparse gradient to be defined. Parameter: {self.names[i]!r}")
        self.observer.launch(b, bucket.grad_nbytes, self.reduction.kind)
        future = self.reduction.launch_sparse(b, p.grad)
        bucket.future = self.observer.launched(b, future, self.reduction.take_work())

    # ------------------------------------------------------------------ phase 4: finalize
    def finalize(self) -> None:
        """Once, at the end of the iteration's backward (queued on the autograd engine): launch
        what is left (unused parameters' buckets, everything under overlap=False or in a
        static graph's first iteration), wait for every bucket in order. A backward that marked
        no gradient (autograd.grad of an input: FGSM, a gradient penalty) leaves the iteration
        open for the backward that will (torch's reducer finalizes only once hooks made it ready)."""
        if not self.hooks_seen:
            self.finalize_queued = False
            return
        if self.counting:  # torch's delay_all_reduce: every bucket now
            self.hook_counts, self.first_counts, self.counting = self.first_counts, None, False
        self.expect_autograd_hooks = self.require_finalize = False
        self._reduce_rest_and_wait()
        self.usage.reduced(self.reduction.usage_flags(len(self.params)), self.ready, self.layout, self.params)
        if not self.rebuilt:  # after the wait's locals are gone, so the old buffers can go
            self.rebuild(self.ready_order)

    def _reduce_rest_and_wait(self) -> None:
        buckets = self.layout.buckets
        self.observer.backward_end(self.next_bucket)
        for b in range(self.next_bucket, len(buckets)):
            self._launch(b)
        self.next_bucket = len(buckets)
        scale = self.uneven.grad_scale() if self.uneven is not None else None
        wire_bytes = 0
        for b, bucket in enumerate(buckets):  # in order; each result lands in its buffer
            result = bucket.future.wait()
            self.observer.done(b)
            bucket.future = None  # nothing outlives the step (a Work holds its tensors)
            if result is _Skipped:  # skip_all_reduce_unused_params: the gradients stayed home
                continue
            if bucket.sparse:
                wire_bytes += self._finish_sparse(bucket, result, scale)
                continue
            wire_bytes += self.reduction.finish(b, result)
            if scale is not None:  # averaged over the ranks still training, not the initial world
                bucket.buffer.mul_(scale)
            for fn in self.reduced_callbacks:  # e.g. step this bucket's parameters now
                fn(b)
        self.observer.wait_end(wire_bytes)

    def _finish_sparse(self, bucket, result, scale) -> int:
        p = self.params[bucket.param_ids[0]]
        result = result[0] if isinstance(result, list) else result
        if scale is not None:
            result = result * scale
        p.grad = result
        return result.coalesce().values().nbytes if result.is_sparse else result.nbytes

    # ------------------------------------------------------------------ join's shadow
    def shadow_iteration(self) -> None:
        """A rank out of data under join(): zeros in every bucket's collective, in order, and the
        one rebuild the others do after their first iteration."""
        futures = [self.reduction.shadow(b) for b in range(len(self.layout.buckets))]
        for f in futures:
            f.wait()
        if not self.rebuilt:
            self.rebuild([])

    def _undefined_grad(self, p: torch.Tensor, view: torch.Tensor) -> None:
        """A hook saw .grad None: the gradient is undefined (an autograd.Function returned None).
        torch's reducer reduces zeros in its place: .grad is that average without
        find_unused_parameters; with it the parameter counts as unused here."""
        if self.expect_autograd_hooks and not self.find_unused:
            view.zero_()
            p.grad = view


def _check_sparse_options(options: dict, names: list[str]) -> None:
    """A sparse gradient is reduced as it is, by the backend's all-reduce or a comm hook."""
    clash = [f"{k}={options[k]!r}" for k, default in (("shard_optimizer", False), ("compress", None),
                                                       ("algorithm", "native"), ("optimizer_overlap", False))
             if options[k] != default]
    if clash:
        raise ValueError(f"minddp: {names} produce sparse gradients (sparse=True), which are all-reduced as "
                         f"they are; {', '.join(clash)} works on flat dense buckets only: drop it, or build "
                         "the embedding with sparse=False")


class _OutputReached:
    """A prehook on an output's autograd node: the forward's own backward got there."""

    def __init__(self, reducer: Reducer):
        self.reducer = weakref.ref(reducer)

    def __call__(self, grad_outputs):
        reducer = self.reducer()
        if reducer is not None:
            reducer.output_reached()


class _Skipped:
    """A bucket whose parameters are all unused here, under skip_all_reduce_unused_params (which
    needs find_unused_parameters): its gradients are not reduced, torch's meaning (the unused set
    must then be the same on every rank, as in torch); the flags bucket's usage flags still are."""

    def __init__(self, flags_future):
        self.flags = flags_future

    def done(self) -> bool:
        return self.flags is None or self.flags.done()

    def wait(self):
        if self.flags is not None:
            self.flags.wait()
        return _Skipped
