"""One optimizer protocol over the engine, whatever holds the optimizer states.

    ReplicatedOptimizer   every rank steps every parameter (torch DDP's way)      minddp.optim.replicated
    ShardedOptimizer      each rank steps its 1/n shard, then all-gathers (ZeRO-1) minddp.optim.zero
    OverlappedOptimizer   each bucket stepped as soon as it is reduced             minddp.optim.overlap

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

from .. import _compat
from ..parallel import tensor_parallel as tp


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

    def sharded_state_dict(self) -> dict:
        """The protocol's state dict in a rank's own parts: here every rank holds all of it."""
        return self.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optim.load_state_dict(sd)


class BucketSteps:
    """One torch optimizer stepped one bucket at a time (OverlappedOptimizer: as each bucket is
    reduced; ShardedOptimizer: each shard, its all-gather launched right after).

    `cuts[b]` is bucket b's parameters, per param group (the same tensors the optimizer holds).
    Adam and AdamW (the trainer's), once every parameter of the bucket has its state and no step
    hook is registered, get their functional step straight on the bucket's tensor lists, built once:
    the same call `optimizer.step()` makes for those tensors, without its per-call walk over groups
    and state, so the results are bitwise equal. Any other case steps the optimizer itself, its
    groups cut down to the bucket for the call (its hooks run; an LR scheduler sees it stepped).
    """

    def __init__(self, optimizer, cuts: list[list[list[torch.Tensor]]]):
        self.optim, self.cuts = optimizer, cuts
        self._lists: dict[int, list] = {}  # bucket -> per group: the functional step's arguments
        self._state = None  # the state dict the lists were built from (load_state_dict replaces it)

    @torch.no_grad()
    def step(self, b: int) -> None:
        lists = self._fast_lists(b)
        if lists is None:
            return self._step_cut(b)
        from torch.optim.adam import adam

        groups = self.optim.param_groups
        for g, (params, grads, avgs, sqs, maxes, steps, cplx, _) in lists:
            group = groups[g]
            adam(params, grads, avgs, sqs, maxes, steps, amsgrad=group["amsgrad"], has_complex=cplx,
                 beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=group["foreach"], capturable=group["capturable"],
                 differentiable=group["differentiable"], fused=group["fused"],
                 decoupled_weight_decay=group["decoupled_weight_decay"])

    def _fast_lists(self, b: int):
        """Bucket b's (group, tensor lists) for the functional Adam step, or None (the generic path)."""
        opt = self.optim
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or _compat.optimizer_step_hooked(opt):
            return None
        if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
            return None
        if self._state is not opt.state:
            self._lists, self._state = {}, opt.state
        lists = self._lists.get(b)
        if lists is None or not self._current(b, lists):
            lists = self._lists[b] = self._build(b)
        return lists

    def _current(self, b: int, lists) -> bool:
        """The built lists still hold every parameter's .grad and optimizer state (a parameter left
        without a gradient is skipped by optimizer.step(): so is it here, by the generic path)."""
        state = self.optim.state
        return all(p.grad is grad and state.get(p) is st for _, (params, grads, *_, states) in lists
                   for p, grad, st in zip(params, grads, states))

    def _build(self, b: int):
        opt, out = self.optim, []
        for g, params in enumerate(self.cuts[b]):
            group = opt.param_groups[g]
            if not params:
                continue
            states = [opt.state.get(p) for p in params]
            if (group["capturable"] or group["differentiable"] or "decoupled_weight_decay" not in group
                    or not all(states) or any(p.grad is None or p.grad.is_sparse for p in params)):
                return None  # the first step makes the states; the generic path covers the rest
            maxes = [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else []
            out.append((g, (params, [p.grad for p in params], [s["exp_avg"] for s in states],
                            [s["exp_avg_sq"] for s in states], maxes, [s["step"] for s in states],
                            any(torch.is_complex(p) for p in params), states)))
        return out

    def _step_cut(self, b: int) -> None:
        """optimizer.step() with its groups cut down to bucket b, and put back after."""
        opt = self.optim
        groups = opt.param_groups
        whole = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, self.cuts[b]):
                g["params"] = params
            opt.param_groups = [g for g in groups if g["params"]]
            opt.step()
        finally:
            opt.param_groups = groups
            for g, params in zip(groups, whole):
                g["params"] = params
