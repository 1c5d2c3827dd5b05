"""The optimizer step overlapped with communication (`OverlappedOptimizer`).

It keeps minddp.optim's protocol and plugs into the engine through its declared callback
(`ddp.on_reduced`): the engine calls it with bucket b right after bucket b's reduction arrives.
"""

from __future__ import annotations

import torch

from .replicated import BucketSteps, ReplicatedOptimizer


class OverlappedOptimizer(ReplicatedOptimizer):
    """The optimizer step overlapped with communication (`DDP(..., optimizer_overlap=True)`).

        ddp = minddp.DDP(model, optimizer_overlap=True)
        opt = minddp.OverlappedOptimizer(ddp, torch.optim.AdamW, param_groups, lr=1e-3)
        loss.backward()   # bucket b's parameters are stepped as soon as bucket b is reduced
        opt.step()        # nothing left to do (the step happened at the end of backward)
        opt.zero_grad()

    At the end of backward the engine waits for its buckets in order; right after bucket b's
    reduction arrives, the inner optimizer steps bucket b's parameters (its param groups cut
    down to them, options kept), while the later buckets are still in flight. (Not earlier:
    the step waits for backward's last kernel, so autograd never sees a parameter change.)
    For an element-wise optimizer (AdamW, SGD with momentum, ...) stepping the parameters in
    parts is exactly one ordinary step; a non-element-wise one (LAMB's per-layer trust
    ratio is fine, a global one is not) would differ.

    Gradient clipping by the global norm needs every bucket before the first step, so it is
    refused (`ddp.clip_grad_norm_` raises; `ddp.grad_norm()` still reads the norm), and so is
    skipping a step after the fact: the trainer refuses ddp.optimizer_overlap=true with
    optim.grad_clip > 0 or train.on_nonfinite=skip.
    """

    def __init__(self, ddp, optimizer_class, params=None, tp_group=None, tp_size: int = 1, **defaults):
        if not getattr(ddp, "optimizer_overlap", False):
            raise ValueError("OverlappedOptimizer needs the engine built with "
                             "DDP(..., optimizer_overlap=True)")
        super().__init__(ddp, optimizer_class, params if params is not None else ddp.module.parameters(),
                         tp_group, tp_size, **defaults)
        self._steps: tuple[int, BucketSteps] | None = None  # (layout version, its per-bucket steps)
        self.steps_taken = 0  # bucket steps since the last step() call
        ddp.on_reduced(self._step_bucket)

    def _bucket_steps(self) -> BucketSteps:
        """Per bucket, per param group: the bucket's parameters, cut once per bucket layout."""
        layout = self.ddp.layout
        if self._steps is None or self._steps[0] != layout.version:
            cuts = []
            for bucket in layout.buckets:
                mine = {id(self.ddp.params[i]) for i in bucket.param_ids}
                cuts.append([[p for p in g["params"] if id(p) in mine] for g in self.optim.param_groups])
            self._steps = (layout.version, BucketSteps(self.optim, cuts))
        return self._steps[1]

    def _step_bucket(self, b: int) -> None:
        """Step bucket b's parameters now (the engine calls it once bucket b is reduced): the one
        torch optimizer, so its step hooks and LR scheduler's bookkeeping hold (minddp.optim.BucketSteps:
        its functional step on the bucket's tensors, or its step() with its groups cut to them)."""
        self._bucket_steps().step(b)
        self.steps_taken += 1

    def step(self, closure=None) -> None:
        """The step already happened, bucket by bucket, at the end of the synchronised backward."""
        if closure is not None:
            raise ValueError("OverlappedOptimizer steps inside backward: a closure cannot be re-evaluated")
        self.steps_taken = 0

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.ddp.clip_grad_norm_(max_norm)  # refused, naming why (checks.check_clip)
