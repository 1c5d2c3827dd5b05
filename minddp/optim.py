"""One optimizer protocol over the engine, whatever holds the optimizer states.

    ReplicatedOptimizer   every rank steps every parameter (torch DDP's way)      minddp.optim
    ShardedOptimizer      each rank steps its 1/n shard, then all-gathers (ZeRO-1) minddp.zero
    OverlappedOptimizer   each bucket stepped as soon as it is reduced             minddp.overlap

All three take `(ddp, optimizer_class, params=None, tp_group=None, tp_size=1, **defaults)` and
offer the same calls, so a training loop never asks which one it has:

    step(), zero_grad(set_to_none=True)
    grad_norm(), clip_grad_norm_(max_norm)   global norms, data- and tensor-parallel aware, no host
                                             sync (the overlapped one refuses to clip, naming why)
    wait_params()                            parameters readable outside a forward (ZeRO-1's gathers)
    state_dict(), load_state_dict(sd)        the unsharded torch optimizer's, loadable by any of them
    original_params()                        the parameters in the order of that state dict's indices
    param_groups, optim                      the inner torch optimizer (an LR scheduler attaches to it)
    exposed_gather_s                         seconds the forward waited for ZeRO-1's gathers, or None
"""

from __future__ import annotations

import torch

from . import tensor_parallel as tp


class ReplicatedOptimizer:
    """A torch optimizer over a DDP engine's (replicated) parameters, with the protocol above."""

    exposed_gather_s = None  # nothing is gathered

    def __init__(self, ddp, optimizer_class, params=None, tp_group=None, tp_size: int = 1, **defaults):
        self.ddp, self.tp_group, self.tp_size = ddp, tp_group, tp_size
        self.optim = optimizer_class(params if params is not None else ddp.parameters(), **defaults)

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def step(self, closure=None):
        return self.optim.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def grad_norm(self) -> torch.Tensor:
        if self.tp_size > 1:
            return tp.grad_norm(list(self.ddp.module.parameters()), self.tp_group, self.tp_size)
        return self.ddp.grad_norm()  # straight from the flat buckets: a kernel per bucket

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if self.tp_size > 1:
            return tp.clip_grad_norm_(list(self.ddp.module.parameters()), max_norm, self.tp_group,
                                      self.tp_size)
        return self.ddp.clip_grad_norm_(max_norm)

    def wait_params(self) -> None:
        pass  # every rank holds every parameter

    def original_params(self) -> list[torch.Tensor]:
        """The parameters in the order of the state dict's indices (torch's: group order)."""
        return [p for g in self.optim.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optim.load_state_dict(sd)
