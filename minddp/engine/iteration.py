"""One synchronised backward: its state, and the only code that changes it.

`Reducer.prepare_for_backward` creates an `Iteration`, the hooks mark parameters ready in it
(`mark_ready`, which says when buckets became launchable), buckets go out from it strictly in
index order (`take_launchable`), and `Reducer.finalize_backward` drops it. Between two
iterations there is none: a hook then only leaves its gradient in `.grad`. Nothing here
outlives its backward: each started collective is let go as it is waited for.

Per parameter i:
    ready[i]      it was marked ready (torch's mark_variable_ready): its bucket counts it
    used[i]       it received a gradient (torch's local_used_map): what the usage flags carry;
                  an unused one contributes its `.grad` as it is, or zeros
Per bucket b:
    pending[b]    parameters still to be marked ready; 0: the bucket is complete
    fresh[b]      parameters whose gradient arrived as a tensor of its own (`.grad` was None,
                  the default of `zero_grad()`): copied into the bucket in one call at launch
    launched[b]   the collective it started (minddp.engine.communicator.Started), until waited for
    unused[b]     (parameter, its .grad was None) for each unused parameter it carried
And: `pointed` (parameters whose `.grad` None was pointed at its bucket view when the forward
ended: one no gradient reaches gets None back), `next_bucket` (the first bucket not launched), `ready_order` (the order parameters became
ready, kept until the one rebuild: its plan), `grad_scale` (join's factor for the gradients).

Watched per bucket (the default once the buckets are rebuilt, minddp.engine.reducer), no hook
comes per parameter: `versions[b]` is bucket b's buffer version counter when the backward
started, and its watched hook finds it complete with `bucket_arrived`; `lost_track` when one was
not (everything left then goes out at the end).

`static_graph` (torch's `_set_static_graph`) is `StaticGraph`'s: how many hooks each parameter
gets, learned in the first iteration, counted down in each later one.
"""

from __future__ import annotations


class StaticGraph:
    """static_graph's one piece of knowledge: the hooks each parameter gets per iteration (a
    shared weight, or one checkpointed twice, gets several). The first iteration learns them
    (`counts` is None until it ends: nothing is launched before its end, torch's delayed
    all-reduce); a later one marks a parameter ready at its last hook, and a parameter with no
    hook then never comes."""

    def __init__(self):
        self.counts: list[int] | None = None

    @property
    def learning(self) -> bool:
        return self.counts is None

    def learn(self, counts: list[int]) -> None:
        self.counts = counts


class Iteration:
    def __init__(self, bucket_of: list[int], bucket_sizes: list[int], static: StaticGraph | None = None,
                 grad_scale: float | None = None, record_order: bool = True, pointed: list[int] = (),
                 versions: list[int] | None = None):
        n, nb = len(bucket_of), len(bucket_sizes)
        self.bucket_of = bucket_of  # the layout's map, parameter -> bucket (shared, read only)
        self.ready = bytearray(n)
        # watched per bucket: each bucket's buffer version when the backward starts; every
        # parameter counts as used (a bucket found incomplete hands over to per-gradient hooks)
        self.versions = versions
        self.lost_track = False
        self.used = bytearray(b"\x01" * n) if versions is not None else bytearray(n)
        self.ready_order: list[int] | None = [] if record_order else None
        counts = static.counts if static is not None else None
        self.hook_counts = [0] * n if static is not None and counts is None else None  # learning
        self.hooks_left = list(counts) if counts is not None else None  # counting down
        self.plain = static is None  # one hook per parameter: ready at it
        if counts is None:
            self.pending = list(bucket_sizes)
        else:  # a parameter with no hook in the first iteration is never waited for
            self.pending = [0] * nb
            for i, c in enumerate(counts):
                self.pending[bucket_of[i]] += c > 0
        self.marked_unused = 0  # marked ready without a gradient (find_unused_parameters)
        self.complete = self.pending.count(0)  # buckets whose every gradient is ready
        self.fresh: list[list[int]] = [[] for _ in range(nb)]
        self.launched: list = [None] * nb
        self.unused: list[list[tuple[int, bool]]] = [[] for _ in range(nb)]
        self.next_bucket = 0
        self.pointed = pointed  # `.grad` None pointed at its view at the forward's end (grads.point_at_views)
        self.grad_scale = grad_scale  # join(divide_by_initial_world_size=False): world / ranks training
        # the reducer's, at the first mark: a backward that marks nothing (autograd.grad of an
        # input) ends nothing; a parameter marked ready must finish before the next iteration
        self.marked_any = False
        self.require_finalize = False
        self.finalize_queued = False  # the end-of-backward callback is queued once
        self.output_watched = False  # a prehook on the forward's output will queue it

    @property
    def counting_hooks(self) -> bool:
        """static_graph's first iteration: hooks are counted, every bucket goes out at the end."""
        return self.hook_counts is not None

    def mark_ready(self, i: int, used: bool, fresh: bool) -> bool:
        """Parameter i is ready (`fresh`: its gradient is a tensor of its own, not yet in the
        bucket). True when its bucket became complete. A second mark
        raises `MarkedTwice` (the reducer names the parameter)."""
        if self.ready[i]:
            raise MarkedTwice(i)
        self.ready[i] = 1
        if used:
            self.used[i] = 1
        else:
            self.marked_unused += 1
        if self.ready_order is not None:
            self.ready_order.append(i)
        b = self.bucket_of[i]
        if fresh:
            self.fresh[b].append(i)
        left = self.pending[b] - 1
        self.pending[b] = left
        if left:
            return False
        self.complete += 1
        return True

    def bucket_arrived(self, b: int, fresh: list[int]) -> None:
        """Watched per bucket: bucket b is complete (`fresh`: its gradients that arrived as tensors
        of their own, to land at launch)."""
        if self.pending[b]:
            self.pending[b] = 0
            self.complete += 1
        self.fresh[b] = fresh

    def lose_track(self) -> None:
        """A watched bucket was incomplete at its hook (the graph changed its order, or a
        gradient did not come): nothing more goes out before the backward ends."""
        self.lost_track = True

    def count_hook(self, i: int, used: bool) -> bool:
        """static_graph: one hook of parameter i. While learning, counts it (never ready: every
        bucket goes out at the end); later, True at its last hook (then `mark_ready`). A hook
        the first iteration did not see raises `GraphChanged`."""
        self.marked_any = True
        if self.hook_counts is not None:
            if not self.hook_counts[i] and self.ready_order is not None:
                self.ready_order.append(i)
            self.hook_counts[i] += 1
            self.used[i] = self.used[i] or used
            return False
        if self.hooks_left[i] <= 0:
            raise GraphChanged(i)
        self.hooks_left[i] -= 1
        return self.hooks_left[i] == 0

    def first_mark(self) -> bool:
        """A gradient is marked for the first time: the iteration now must finish before the next
        starts. True when nothing else will end it (no output was watched): the caller queues
        the finalize at this backward's end."""
        self.marked_any = self.require_finalize = True
        return not self.output_watched

    def watch(self) -> None:
        self.output_watched = True

    def queue_finalize(self) -> bool:
        """True the first time: the end-of-backward callback is to be queued now."""
        queued, self.finalize_queued = self.finalize_queued, True
        return not queued

    def unqueue_finalize(self) -> None:
        """A backward that marked nothing ended: the next one queues the finalize again."""
        self.finalize_queued = False

    def abandon(self) -> None:
        """A new forward found this iteration unfinished (the reducer raises torch's error)."""
        self.require_finalize = False

    def started(self, b: int, started) -> None:
        self.launched[b] = started

    def take_started(self, b: int):
        """Bucket b's started collective, let go here (a Work holds its tensors)."""
        started, self.launched[b] = self.launched[b], None
        return started

    def note_unused(self, b: int, i: int, grad_was_none: bool) -> None:
        self.unused[b].append((i, grad_was_none))

    def used_or(self, mask: bytes | None) -> bytes:
        """`used`, with the parameters of `mask` (if any) counted as used too."""
        return bytes(u | m for u, m in zip(self.used, mask)) if mask else bytes(self.used)

    def take_unmarked_pointed(self) -> list[int]:
        """The pointed parameters no hook marked (their `.grad` goes back to None), taken once."""
        pointed, self.pointed = self.pointed, ()
        if not pointed or (self.marked_any and self.all_complete() and not self.marked_unused):
            return []  # every parameter was marked ready with a gradient
        return [i for i in pointed if not self.ready[i]]

    def take_launchable(self) -> range:
        """The complete buckets from `next_bucket` on, in index order, now taken for launch."""
        start, n = self.next_bucket, len(self.pending)
        if self.lost_track:
            return range(start, start)
        while self.next_bucket < n and self.pending[self.next_bucket] == 0:
            self.next_bucket += 1
        return range(start, self.next_bucket)

    def take_rest(self) -> range:
        """Every bucket not launched yet (the end of the backward)."""
        start, self.next_bucket = self.next_bucket, len(self.pending)
        return range(start, self.next_bucket)

    def all_complete(self) -> bool:
        return self.complete == len(self.pending)


class MarkedTwice(RuntimeError):
    """A parameter marked ready twice in one iteration (its index: the reducer words torch's error)."""


class GraphChanged(RuntimeError):
    """static_graph: a hook the first iteration did not see."""
