"""The reducer: owns the buckets and drives each iteration, in torch's reducer's phases and names
(minddp.engine's docstring tells the iteration): prepare_for_backward, autograd_hook /
mark_variable_ready, launch_ready_buckets, finalize_backward. It creates and drops each
`Iteration` (minddp.engine.iteration), which holds and changes that backward's state.

The default iteration (no unused parameters, no static graph, no sparse gradients) runs no Python
per gradient: every `.grad` is its bucket view when the backward starts, autograd adds into it,
and from the second iteration one hook per bucket (`bucket_hook`, on the gradient observed to
arrive last) checks the bucket's buffer version counter. The first iteration, and whatever needs
each gradient seen, hooks every parameter (`autograd_hook`, a handful of list operations each);
the rare cases take `_rare_hook`: a hook outside an iteration, an undefined or sparse gradient,
static_graph's counted hooks. torch's rules, each applied where it is written:
- only a synchronised forward (grad enabled, outside `no_sync()`) starts an iteration; a hook
  outside one (no_sync, a backward through the plain module, a second backward of a retained
  graph) just leaves the local gradient in .grad;
- `finalize_backward` is queued once per iteration: by a prehook on the forward's output nodes
  (that backward, not a reentrant checkpoint's nested recomputation), or when every bucket is
  complete, or at the first hook when no output carries a graph; a backward that marked nothing
  (autograd.grad of an input) leaves the iteration open;
- `static_graph`: the first iteration counts each parameter's hooks and reduces everything at its
  end (torch's delayed all-reduce); later iterations mark a parameter ready at its last hook;
- a parameter marked ready means the iteration must finish before the next one starts (torch's
  "Expected to have finished reduction in the prior iteration");
- an unused parameter (no gradient this backward) is found when its bucket goes out: it
  contributes what its .grad holds (zeros if None), and the usage flags say which parameters
  some rank left unused.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.distributed as dist

from .. import _compat
from . import grads, hooks
from .buckets import Layout, TensorSpec, assign_buckets
from .communicator import Communicator, Started
from .iteration import GraphChanged, Iteration, MarkedTwice, StaticGraph
from .observer import observer_for
from .options import Options
from .reductions import make_reduction
from .usage import UsageFlags

# torch's texts (reducer.cpp, distributed.py), so scripts that match them keep working
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
STATIC_GRAPH_TOO_LATE = ("set_static_graph() should be called before training loop starts and after "
                         "DistributedDataParallel is constructed")


class Reducer:
    """Owns the buckets and drives the iterations of one DistributedDataParallel (module doc)."""

    def __init__(self, params, names, group, device, options: Options, sparse: list[bool], mixed=None):
        self.params, self.names, self.group, self.device = params, names, group, device
        self.options = options
        self.src_rank = dist.get_process_group_ranks(group)[0]  # global (broadcast's src)
        self.sparse = sparse  # torch's expect_sparse_gradient: its own bucket, reduced as it is
        self.sparse_mask = bytes(sparse) if any(sparse) else None  # they count as used
        if any(sparse):
            _check_sparse_options(options, [n for n, s in zip(names, sparse) if s])
        self.mixed = mixed  # mixed precision's casts (minddp.engine.mixed_precision), or None
        comm = Communicator(group, options.reduce_op, options.algorithm, options.ranks_per_node)
        self.reduction = mixed.reduction(comm, params) if mixed else make_reduction(comm, options, params)
        self.observer = observer_for(device, options.overlap)
        self.usage = UsageFlags(names, tolerate_unused=options.find_unused_parameters)
        self.reduced_callbacks, self.rebuild_callbacks = [], []  # on_reduced(fn), on_rebuild(fn)
        self.static: StaticGraph | None = None  # set_static_graph(), before the first iteration
        self.hook_registered = False
        self.rebuilt = False  # the buckets are rebuilt once, after the first iteration
        self.iterations = 0  # synchronised iterations started (torch's num_iterations_)
        self.layout: Layout | None = None
        self.bucket_of: list[int] = []  # the layout's parameter -> bucket, and each bucket's size
        self.bucket_sizes: list[int] = []
        self.views: tuple = ()  # the layout's gradient views (None: a sparse gradient)
        self.hooks = hooks.GradHooks(params)  # per parameter, or watched per bucket (`watching`)
        self.watching = False
        self.lost_track = False  # a watched bucket was found incomplete: per parameter from then on
        self.dense_groups: list = []  # per dense bucket (bucket, its parameters, their views)
        self.flags_view: torch.Tensor | None = None  # the layout's usage flags (minddp.engine.usage)
        self.iteration: Iteration | None = None  # between prepare_for_backward and finalize_backward

    # ------------------------------------------------------------------ the buckets
    def build_layout(self, order: list[int]) -> None:
        """(Re)allocate the flat buffers for `order`; existing gradients move into them. Dense
        buckets by torch's size rule, then one bucket per sparse parameter."""
        o = self.options
        specs = [TensorSpec.of(p) for p in self.params]
        dense = [i for i in order if not self.sparse[i]]
        assignment = assign_buckets(specs, dense, o.bucket_cap_mb, strict=o.strict_bucket_cap,
                                    caps_mb=o.bucket_cap_mb_list) if dense else []
        assignment += [[i] for i in order if self.sparse[i]]
        version = self.layout.version + 1 if self.layout is not None else 1
        for fn in self.rebuild_callbacks:  # e.g. a sharded optimizer drops its views of the old buffers
            fn(self.layout)
        self.layout, self.views, self.dense_groups, self.flags_view = None, (), [], None
        self.reduction.bind(None)  # let each old buffer go once its last gradient has moved
        shards = self.reduction.pad_to
        me = dist.get_group_rank(self.group, dist.get_rank()) if shards > 1 else 0
        self.layout = Layout.build(self.params, assignment, tail_numel=len(self.params), shards=shards,
                                   shard_index=me, version=version, sparse=self.sparse,
                                   flat_params=self.reduction.flat_params,
                                   dtype=self.mixed.param_dtype if self.mixed else None)
        self.reduction.bind(self.layout)
        self.bucket_of = [self.layout.bucket_of(i) for i in range(len(self.params))]
        self.bucket_sizes = [len(b.param_ids) for b in self.layout.buckets]
        self.views = self.layout.views
        self.flags_view = self.layout.flags(len(self.params))
        self.dense_groups = [(b, [self.params[i] for i in b.param_ids], [self.views[i] for i in b.param_ids])
                             for b in self.layout.buckets if not b.sparse]
        self.observer.layout_changed(len(self.layout.buckets))

    @property
    def static_graph(self) -> bool:
        return self.static is not None

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

    def on_reduced(self, fn) -> None:
        self.reduced_callbacks.append(fn)

    def on_rebuild(self, fn) -> None:
        self.rebuild_callbacks.append(fn)

    def set_static_graph(self) -> None:
        """torch's `_set_static_graph`: before the first iteration, once (the wrapper warns on a
        second call). Unused parameters are then tolerated, as with find_unused_parameters."""
        if self.iterations:
            raise RuntimeError(STATIC_GRAPH_TOO_LATE)
        self.static = StaticGraph()
        if not self.usage.tolerate_unused:  # nothing is pending before the first iteration
            self.usage = UsageFlags(self.names, tolerate_unused=True)
        if self.options.find_unused_parameters:  # torch's warning, word for word
            warnings.warn("You passed find_unused_parameters=true to DistributedDataParallel, "
                          "`_set_static_graph` will detect unused parameters automatically, so you do not "
                          "need to set find_unused_parameters=true, just be sure these unused parameters "
                          "will not change during training loop while calling `_set_static_graph`.",
                          stacklevel=3)

    # ------------------------------------------------------------------ phase 1: prepare
    def prepare_for_backward(self, outputs=(), grad_scale: float | None = None) -> bool:
        """A synchronised forward: a new iteration (torch's prepare_for_backward, which libraries
        such as Lightning also call from outside the forward), ended by the backward that reaches
        `outputs` (any structure of tensors; none: the end of the first backward that marks a
        gradient). Not when the forward is a checkpoint's recomputation inside this iteration's
        backward: the iteration goes on (returns False). `grad_scale`: join's factor for the
        reduced gradients (averaged over the ranks still training), or None."""
        it = self.iteration
        if it is not None and _compat.in_backward():
            return False
        if it is not None and it.require_finalize:  # marked gradients ready but never finished
            it.abandon()
            raise RuntimeError(NOT_FINISHED)
        self.iterations += 1
        buckets = self.layout.buckets
        pointed = grads.point_at_views(self.dense_groups) if self._accumulates_in_buckets else ()
        versions = [_compat.version_of(b.buffer) for b in buckets] if self.watching else None
        self.iteration = Iteration(self.bucket_of, self.bucket_sizes, self.static, grad_scale,
                                   record_order=not self.rebuilt, pointed=pointed, versions=versions)
        self.observer.start(len(self.layout.buckets))
        self._watch(outputs)
        return True

    @property
    def _accumulates_in_buckets(self) -> bool:
        """Whether every `.grad` is made its bucket view before the backward, so autograd adds
        into the bucket (one add per gradient, where torch's reducer copies each in with its
        1/n): not where a parameter without a gradient must keep `.grad` None
        (find_unused_parameters, static_graph, as torch), nor under mixed precision (the
        buffer holds param_dtype)."""
        return self.mixed is None and not self.usage.tolerate_unused

    # ------------------------------------------------------------------ the hooks
    def hook_all(self) -> None:
        """A hook on every parameter (`autograd_hook`): the first iteration, which observes the
        order gradients arrive in, and whatever needs each gradient seen."""
        self.watching = False
        self.hooks.set(hooks.per_parameter(self, len(self.params)))

    def _choose_hooks(self) -> None:
        """Once the buckets are rebuilt in the observed order, the default iteration watches one
        gradient per bucket, the one observed to arrive last (`bucket_hook`): no Python runs per
        gradient. Per parameter where the rules need each one (static_graph, unused
        parameters, sparse or mixed-precision gradients) or a watched bucket was once found
        incomplete (a graph whose order changes)."""
        watch = (self.rebuilt and self._accumulates_in_buckets and self.static is None
                 and self.sparse_mask is None and not self.lost_track)
        if watch == self.watching:
            return
        if not watch:
            return self.hook_all()
        self.watching = True
        self.hooks.set(hooks.per_bucket(self, {b.index: b.param_ids[-1] for b in self.layout.buckets}))

    def _rebuild_buckets(self) -> bool:
        """torch's entry, called by libraries before `prepare_for_backward`: minddp rebuilds its
        buckets once by itself, at the end of the first iteration, so there is nothing to do."""
        return False

    def _delay_all_reduce(self) -> None:
        """torch's entry (Lightning calls it after a static graph's first manual backward): reduce
        what the iteration marked now. minddp's finalize already ran at the end of that backward,
        so this only finishes an iteration a backward left open."""
        if self.iteration is not None and self.iteration.marked_any and not _compat.in_backward():
            self.finalize_backward()

    def _watch(self, outputs) -> None:
        """Queue the finalize when the backward of this forward's graph reaches its output (torch's
        _DDPSink, without a node of its own): that backward, not a nested recomputation's, ends
        the iteration. Nothing is kept but the prehook."""
        for t in _compat.output_tensors(outputs):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(_OutputReached(self))
                self.iteration.watch()

    def output_reached(self) -> None:
        if self.iteration is not None:
            self._queue_finalize()

    def _queue_finalize(self) -> None:
        if self.iteration.queue_finalize():
            _compat.queue_autograd_callback(self.finalize_backward)

    # ------------------------------------------------------------------ phase 2: mark ready
    def autograd_hook(self, i: int, p: torch.Tensor) -> None:
        """Parameter i's gradient was accumulated (a post-accumulate-grad hook). The default
        iteration notes whether the gradient is fresh (a tensor of its own, not its bucket view:
        it lands with its bucket at launch) and marks it ready; nothing else per gradient."""
        it, grad, view = self.iteration, p.grad, self.views[i]
        if it is None or grad is None or view is None or not it.plain:
            return self._rare_hook(it, i, p, grad, view)
        self.mark_variable_ready(i, True, grad is not view)

    def mark_variable_ready(self, i: int, used: bool, fresh: bool = False) -> None:
        it = self.iteration
        if not it.marked_any and it.first_mark():  # no output to wait for: this backward's end
            self._queue_finalize()
        try:
            complete = it.mark_ready(i, used, fresh)
        except MarkedTwice:
            raise RuntimeError(f"{MARKED_TWICE} Parameter: {self.names[i]!r}.") from None
        if complete:
            self.launch_ready_buckets()

    def bucket_hook(self, b: int, p: torch.Tensor) -> None:
        """Watched per bucket: the gradient observed to arrive last in bucket b was accumulated.
        The bucket is complete when its buffer's version counter moved once per parameter
        (autograd adds into each view in place), with any fresh gradients counted in."""
        it = self.iteration
        if it is None or it.versions is None:  # outside an iteration: a local gradient, as torch
            return
        if not it.marked_any and it.first_mark():
            self._queue_finalize()
        if not it.pending[b]:  # its watched gradient came twice (reentrant backwards)
            raise RuntimeError(f"{MARKED_TWICE} Parameter: {self.names[self._watched(b)]!r}.")
        if it.lost_track:
            return
        fresh, complete = self._arrived(it, b)
        if not complete:
            return self._lose_track(it)
        it.bucket_arrived(b, fresh)
        self.launch_ready_buckets()

    def _watched(self, b: int) -> int:
        """The parameter watched in bucket b."""
        return self.layout.buckets[b].param_ids[-1]

    def _arrived(self, it: Iteration, b: int) -> tuple[list[int], bool]:
        """(bucket b's fresh gradients, whether every gradient of it arrived)."""
        bucket = self.layout.buckets[b]
        added = _compat.version_of(bucket.buffer) - it.versions[b]
        size = len(bucket.param_ids)
        if added == size:
            return [], True
        fresh = [i for i in bucket.param_ids if self.params[i].grad is not None
                 and self.params[i].grad is not self.views[i]]
        return fresh, added + len(fresh) == size

    def _lose_track(self, it: Iteration) -> None:
        it.lose_track()
        self.lost_track = True  # per parameter from the next iteration on (_choose_hooks)

    def _rare_hook(self, it, i: int, p: torch.Tensor, grad, view) -> None:
        """Outside an iteration (a local gradient, as torch), a sparse or undefined gradient,
        static_graph's counted hooks."""
        if it is None:
            if grad is not None and self.options.find_unused_parameters:  # used in a no_sync() step
                self.usage.note_unsynced_use(i)
            return
        if view is None:  # a sparse gradient: its own bucket, reduced as it is
            return self.mark_variable_ready(i, grad is not None)
        if grad is None and not self.options.find_unused_parameters:
            grads.zero_undefined(p, view)  # torch reduces zeros in its place
        # an undefined gradient is not a use under find_unused_parameters
        used = grad is not None or not self.options.find_unused_parameters
        if it.plain:
            return self.mark_variable_ready(i, used, grad is not None and grad is not view)
        grads.move_into(p, view)  # static_graph: later hooks of this parameter accumulate in place
        if not it.marked_any and not it.output_watched:
            self._queue_finalize()  # (count_hook marks the iteration)
        try:
            last = it.count_hook(i, used)
        except GraphChanged:
            raise RuntimeError(GRAPH_CHANGED) from None
        if last:  # its last hook this iteration (earlier ones: weight sharing, checkpoints)
            self.mark_variable_ready(i, used)

    # ------------------------------------------------------------------ phase 3: launch in order
    def launch_ready_buckets(self) -> None:
        """Strictly in index order: bucket b never goes out before bucket b-1."""
        it = self.iteration
        if self.options.overlap:
            for b in it.take_launchable():
                self._launch(it, b)
        if it.all_complete():  # torch's rule: every bucket is ready (out, with overlap)
            self._queue_finalize()

    def _launch(self, it: Iteration, b: int) -> None:
        bucket = self.layout.buckets[b]
        if bucket.sparse:
            return self._launch_sparse(it, b, bucket)
        if it.pending[b] or it.marked_unused or not it.plain:  # some parameter may be unused
            self._contribute_unused(it, b, bucket)
        if b == self.layout.flags_bucket:  # a sparse gradient counts as used (it travels as it is)
            self.usage.write(self.flags_view, it.used_or(self.sparse_mask))
        self.observer.launch(b, bucket.grad_nbytes, self.reduction.kind)
        if self.options.skip_unused and self.usage.unused_here(it.unused[b], bucket.param_ids):
            flags = self.flags_view if b == self.layout.flags_bucket else None
            flags_started = self.reduction.comm(flags) if flags is not None else Started(None)
            started = Started(_Skipped(flags_started.future), flags_started.work)  # the flags only
        else:
            started = self.reduction.launch(b, it.fresh[b])  # the fresh gradients land there
        it.started(b, started)
        self.observer.launched(b, started)
        self.observer.poll()  # a cheap moment to note earlier buckets' completion (once per bucket)

    def _contribute_unused(self, it: Iteration, b: int, bucket) -> None:
        """Unused this iteration: a parameter contributes what .grad holds, or zeros."""
        for i in bucket.param_ids:
            if not it.used[i]:
                it.note_unused(b, i, grads.contribute_unused(self.params[i], self.layout.views[i]))

    def _launch_sparse(self, it: Iteration, b: int, bucket) -> None:
        i = bucket.param_ids[0]
        p = self.params[i]
        if p.grad is None:  # torch's text (mark_variable_ready_sparse)
            raise RuntimeError(f"Expected sparse gradient to be defined. Parameter: {self.names[i]!r}")
        self.observer.launch(b, bucket.grad_nbytes, self.reduction.kind)
        started = self.reduction.launch_sparse(b, p.grad)
        it.started(b, started)
        self.observer.launched(b, started)

    # ------------------------------------------------------------------ phase 4: finalize
    def finalize_backward(self) -> None:
        """Once, at the end of the iteration's backward (queued on the autograd engine): launch
        what is left (unused parameters' buckets, everything under overlap=False or in a
        static graph's first iteration), wait for every bucket in order, drop the iteration. A
        backward that marked no gradient (autograd.grad of an input: FGSM, a gradient penalty)
        leaves the iteration open for the backward that will (torch's reducer finalizes only
        once hooks made it ready)."""
        it = self.iteration
        if it is None:  # (finalized already: nothing is left to do)
            return
        if not it.marked_any:
            grads.unpoint(self.params, it.take_unmarked_pointed())
            it.unqueue_finalize()
            return
        if it.counting_hooks:  # torch's delay_all_reduce: every bucket now; later iterations count down
            self.static.learn(it.hook_counts)
        if it.versions is not None:
            self._take_watched_rest(it)
        self.iteration = None  # from here on a hook is outside any iteration
        self._reduce_rest_and_wait(it)
        grads.unpoint(self.params, it.take_unmarked_pointed())
        if self.mixed is not None:  # parameters and .grad back in full precision
            self.mixed.to_full_precision(self.layout)
        self.usage.reduced(self.reduction.usage_flags(len(self.params)), it.used, it.unused,
                           self.layout, self.params)
        if not self.rebuilt:  # after the wait's locals are gone, so the old buffers can go
            self.rebuild(it.ready_order)
        self._choose_hooks()

    def _take_watched_rest(self, it: Iteration) -> None:
        """Watched per bucket, the backward's end: the buckets not out yet go now. One still
        incomplete (a gradient that did not come) contributes zeros for it, and per-gradient
        hooks take over from the next iteration (they name a parameter that stays unused)."""
        for b in range(it.next_bucket, len(self.layout.buckets)):
            fresh, complete = self._arrived(it, b)
            if not complete:
                self._lose_track(it)
            it.bucket_arrived(b, fresh)

    def _reduce_rest_and_wait(self, it: Iteration) -> None:
        buckets = self.layout.buckets
        self.observer.backward_end(it.next_bucket)
        for b in it.take_rest():
            self._launch(it, b)
        wire_bytes = 0
        for b, bucket in enumerate(buckets):  # in order; each result lands in its buffer
            result = it.take_started(b).future.wait()  # let go here: a Work holds its tensors
            self.observer.done(b)
            if result is _Skipped:  # skip_all_reduce_unused_params: the gradients stayed home
                continue
            if bucket.sparse:
                wire_bytes += self._finish_sparse(bucket, result, it.grad_scale)
                continue
            wire_bytes += self.reduction.finish(b, result)
            if it.grad_scale is not None:  # averaged over the ranks still training, not the initial world
                bucket.grads.mul_(it.grad_scale)
            for fn in self.reduced_callbacks:  # e.g. step this bucket's parameters now
                fn(b)
        self.observer.wait_end(wire_bytes)

    def _finish_sparse(self, bucket, result, scale) -> int:
        p = self.params[bucket.param_ids[0]]
        result = result[0] if isinstance(result, list) else result
        if scale is not None:
            result = result * scale
        grads.set_sparse(p, result)
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


def _check_sparse_options(options: Options, names: list[str]) -> None:
    """A sparse gradient is reduced as it is, by the backend's all-reduce or a comm hook."""
    clash = [f"{k}={getattr(options, k)!r}" for k, default in (
        ("shard_optimizer", False), ("compress", None), ("algorithm", "native"), ("optimizer_overlap", False),
        ("mixed_precision", None)) if getattr(options, k) != default]
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
