"""Fault injection, to rehearse the failure paths on a real run (train.fault_* keys).

One hook, called once per step after the backward pass; off unless a step is named.
- fault_nan_step/rank: this rank's loss and one gradient become NaN *after* the reduction,
  so only this rank sees it (stepping alone would silently split the replicas).
- fault_sleep_step/rank/s: this rank stalls inside the step, as if stuck in a kernel or
  on a slow filesystem; the others wait in the next collective until train.timeout_s.
  fault_sleep_in=checkpoint_write|checkpoint_delete: it stalls in that step's checkpoint write
  (a background one too) or in retention's deletion instead: a slow disk, and the window a
  crash or an error must meet (`pause`).
"""

from __future__ import annotations

import time

import torch


class Faults:
    def __init__(self, train_cfg, rank: int):
        self.t, self.rank = train_cfg, rank
        # whether after_backward can do anything: a NaN or a stall set for a step
        self.in_step = train_cfg.fault_nan_step is not None or (
            train_cfg.fault_sleep_step is not None and train_cfg.fault_sleep_in == "step")

    def after_backward(self, step: int, model: torch.nn.Module, loss_sum: torch.Tensor) -> None:
        t = self.t
        if step == t.fault_nan_step and self.rank == t.fault_nan_rank:
            loss_sum.fill_(float("nan"))
            next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))
        self.pause("step", step)

    def pause(self, where: str, step: int) -> None:
        """train.fault_sleep_in == where, at fault_sleep_step, on fault_sleep_rank: sleep there."""
        t = self.t
        if where == t.fault_sleep_in and step == t.fault_sleep_step and self.rank == t.fault_sleep_rank:
            time.sleep(t.fault_sleep_s)
