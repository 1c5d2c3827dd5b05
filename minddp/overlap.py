"""The optimizer step overlapped with communication (`OverlappedOptimizer`).

It keeps minddp.optim's protocol and plugs into the engine through its declared callback
(`ddp.on_reduced`): the engine calls it with bucket b right after bucket b's reduction arrives.
"""

from __future__ import annotations

import torch

from .optim import ReplicatedOptimizer


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
        self._cuts: dict[int, list[list[list]]] = {}  # layout version -> per bucket, per group: params
        self.steps_taken = 0  # bucket steps since the last step() call
        ddp.on_reduced(self._step_bucket)

    def _bucket_cut(self, b: int) -> list[list]:
        layout = self.ddp.layout
        if layout.version not in self._cuts:
            self._cuts = {layout.version: []}
            for bucket in layout.buckets:
                mine = {id(self.ddp.params[i]) for i in bucket.param_ids}
                self._cuts[layout.version].append(
                    [[p for p in g["params"] if id(p) in mine] for g in self.optim.param_groups])
        return self._cuts[layout.version][b]

    @torch.no_grad()
    def _step_bucket(self, b: int) -> None:
        """Step bucket b's parameters now (the engine calls it once bucket b is reduced). The one
        torch optimizer steps, its groups cut down to bucket b for the call and put back after:
        an optimizer per bucket would step without the user's optimizer's step hooks and its
        LR scheduler's bookkeeping (it warns when its optimizer never stepped)."""
        opt, cut = self.optim, self._bucket_cut(b)
        groups = opt.param_groups
        whole = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, cut):
                g["params"] = params
            opt.param_groups = [g for g in groups if g["params"]]
            opt.step()
        finally:
            opt.param_groups = groups
            for g, params in zip(groups, whole):
                g["params"] = params
        self.steps_taken += 1

    def step(self, closure=None) -> None:
        """The step already happened, bucket by bucket, at the end of the synchronised backward."""
        if closure is not None:
            raise ValueError("OverlappedOptimizer steps inside backward: a closure cannot be re-evaluated")
        self.steps_taken = 0

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.ddp.clip_grad_norm_(max_norm)  # refused, naming why (ddp_checks.check_clip)
