"""One iteration as a value: everything that lives for one synchronised backward.

`Reducer.prepare_for_backward` creates an `Iteration` (a synchronised forward), the hooks mark
parameters ready in it, buckets go out from it in index order, and `Reducer.finalize_backward`
drops it. Between two iterations there is none: a hook that fires then (a `no_sync()` backward, a
backward through the plain module) only leaves its gradient in `.grad`. Nothing here outlives the
backward it belongs to: the collectives started are let go bucket by bucket as they are waited for.

Per parameter i:
    used[i]          it received a gradient in this backward (torch's local_used_map): what the
                     usage flags carry; an unused one contributes its `.grad` as it is, or zeros
    ready[i]         it was marked ready (torch's mark_variable_ready): its bucket counts it
    hooks_left[i]    static_graph after its first iteration: hooks still to come for it (a shared
                     weight, or one checkpointed twice, gets several; ready at the last one)
    hook_counts[i]   static_graph's first iteration: hooks seen, counted and nothing launched
                     (every bucket goes out at the end, torch's delayed all-reduce)
Per bucket b:
    pending[b]       parameters still to be marked ready; 0: the bucket is complete
    launched[b]      the collective it started (minddp.engine.communicator.Started), until waited for
    unused[b]        (parameter, its .grad was None) for each unused parameter it carried
    scaled_in[b]     how many of its gradients had the average's 1/n fused into their copy
                     (`scaled[i]`, per parameter): the reduction scales the rest at launch
And: `next_bucket` (buckets go out strictly in index order), `ready_order` (the order parameters
became ready: the rebuild's plan), `grad_scale` (join's factor for the reduced gradients).
"""

from __future__ import annotations


class Iteration:
    def __init__(self, layout, num_params: int, hook_counts: list[int] | None, count_hooks: bool,
                 grad_scale: float | None = None):
        self.used = [False] * num_params
        self.ready = [False] * num_params
        self.ready_order: list[int] = []
        # static_graph after its first iteration: a parameter no hook reached then never comes
        self.hooks_left = list(hook_counts) if hook_counts is not None else None
        self.hook_counts = [0] * num_params if count_hooks else None
        self.pending = [sum(1 for i in b.param_ids if hook_counts is None or hook_counts[i] > 0)
                        for b in layout.buckets]
        self.complete = self.pending.count(0)  # buckets whose every gradient is ready
        self.launched: list = [None] * len(layout.buckets)
        self.unused: list[list[tuple[int, bool]]] = [[] for _ in layout.buckets]
        self.scaled = [False] * num_params
        self.scaled_in = [0] * len(layout.buckets)
        self.next_bucket = 0
        self.grad_scale = grad_scale  # join(divide_by_initial_world_size=False): world / ranks training
        self.marked_any = False  # a backward that marks nothing (autograd.grad of an input) ends nothing
        self.require_finalize = False  # a parameter was marked ready: it must finish before the next
        self.finalize_queued = False  # the end-of-backward callback is queued once
        self.output_watched = False  # a prehook on the forward's output will queue it

    @property
    def counting_hooks(self) -> bool:
        """static_graph's first iteration: hooks are counted, every bucket goes out at the end."""
        return self.hook_counts is not None
