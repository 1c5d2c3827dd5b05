"""Whole training loops against each other on the same work (`minddp bench-trainer`'s
measurement): the loops people write by hand on torch DDP, and the rotated rounds that compare
any loops' steps (clock.interleaved), repeated, as ratios of medians to the first loop."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.nn import functional as F

from .. import _compat
from .clock import interleaved, timed


class HandLoop:
    """A training loop as people write it, on torch DDP: `batches.get(i)` gives step i's
    micro-batches [(x, y), ...], accumulated by `require_backward_grad_sync`. `fused`: fused
    AdamW, else its default (foreach) kernel; `nanogpt`: also clipping and `loss.item()` every
    step, as nanoGPT's train.py does with its defaults."""

    def __init__(self, model: nn.Module, batches, accum: int, lr: float, fused: bool, nanogpt: bool):
        self.model = _compat.TORCH_DDP(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=fused or None)
        self.batches, self.accum, self.nanogpt = batches, accum, nanogpt

    def step(self, step: int) -> None:
        for m, (x, y) in enumerate(self.batches.get(step - 1)):
            self.model.require_backward_grad_sync = m == self.accum - 1
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()) / self.accum
            loss.backward()
        if self.nanogpt:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.nanogpt:
            loss.item()


def compare(loops: dict, device, repeats: int, rounds: int, per_round: int) -> tuple[dict, dict]:
    """`loops`: {name: step(i)}, each called with its own step count (1, 2, ... across
    repeats). Per repeat, `rounds` rotated rounds of `per_round` steps of every loop, each step's
    time the slowest rank's: ({name: [median step per repeat]}, {name: [first loop's median /
    this one's, per repeat]})."""
    names, count = list(loops), {k: 0 for k in loops}

    def one(k):
        count[k] += 1
        return timed(lambda: loops[k](count[k]), device)

    medians, ratios = defaultdict(list), defaultdict(list)
    for _ in range(repeats):
        med = [m[0] for m in interleaved([lambda k=k: one(k) for k in names], rounds, per_round, device)]
        for k, m in zip(names, med):
            medians[k].append(m)
            ratios[k].append(med[0] / m)
    return medians, ratios
