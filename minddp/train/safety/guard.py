"""A bound on consecutive skipped steps (train.max_skipped_steps).

With train.on_nonfinite=skip a non-finite loss or gradient skips the step on every rank. A
run whose every step is skipped (optim.lr=1e30, NaN weights in the checkpoint it resumed
from) would otherwise end with exit code 0 and a NaN result: after `limit` skipped steps in a
row every rank stops, naming the cause. The decision follows the all-reduced skip flag, and
the weights' check is one all-reduce, so every rank stops at the same step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class DivergedError(RuntimeError):
    """Training cannot continue: every step is being skipped. Exit code 3 in train.py."""


class SkipGuard:
    """`limit` skipped steps in a row stop the run. `lr`, and the step and checkpoint a run
    resumed from (start 0: a fresh run), only word the cause."""

    def __init__(self, limit: int, lr: float, device, start: int = 0, ckpt_path=None):
        self.limit, self.in_a_row = limit, 0
        self.lr, self.device, self.start, self.ckpt_path = lr, device, start, ckpt_path

    def after_step(self, step: int, skipped: bool, model, opt) -> None:
        """Every rank calls it after every step, with the all-reduced skip flag."""
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.limit and self.in_a_row >= self.limit:
            raise DivergedError(self._cause(step, model, opt))

    def _cause(self, step: int, model, opt) -> str:
        opt.wait_params()
        params = [p.detach().abs().max().double() for p in model.parameters() if p.numel()]
        largest = (torch.stack(params).max() if params else torch.zeros((), dtype=torch.float64))
        largest = largest.reshape(1).to(self.device)  # torch's max keeps a NaN
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # every rank here, at the same step
        first = step - self.in_a_row + 1
        head = (f"{self.in_a_row} steps in a row ({first}..{step}) had a non-finite loss or gradient "
                f"and were skipped (train.max_skipped_steps={self.limit})")
        value = largest.item()
        if not math.isfinite(value):
            where = (f"the checkpoint this run resumed from, {self.ckpt_path}" if self.start and
                     first == self.start + 1 else f"an update before step {first}")
            return (f"{head}: the weights are NaN/inf, from {where}. Resume from an earlier checkpoint "
                    "(train.resume=<path of a ckpt_<step>.pt or ckpt_<step>/>)")
        return (f"{head}: the weights are finite (largest |w| {value:.3g}) but the loss or gradient is "
                f"not: optim.lr={self.lr:g} is likely too high; lower it (or raise "
                "train.max_skipped_steps, 0 for no limit)")
