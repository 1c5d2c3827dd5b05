"""The engine's hot path without extra passes, bitwise against torch DDP on 3 gloo ranks: the
average's 1/n fused into the copy of each fresh gradient into its bucket (and every case where
gradients were not fresh: accumulated under no_sync, zeroed in place, unused), the overlapped
optimizer's per-bucket functional step, ZeRO-1's per-bucket step and gather; and how a bucket's
communication is timed per backend."""


import copy

import pytest
import torch
from torch import nn

import minddp
from tests import launch
from tests.models import MLP, batch, shard


class WithHead(nn.Module):
    """An MLP and a head that ranks use only on some steps (an unused parameter)."""

    def __init__(self):
        super().__init__()
        self.mlp, self.head = MLP(), nn.Linear(4, 4)

    def forward(self, x, use_head):
        y = self.mlp(x)
        return self.head(y) if use_head else y


def _steps(engine, opt, rank, world, zero_in_place, steps=4):
    """Micro-steps under no_sync every other step; the head used on odd steps only."""
    for i in range(steps):
        x, y = batch(i, world)
        use = i % 2 == 1
        if i % 2 == 0:
            with engine.no_sync():
                nn.functional.mse_loss(engine(shard(x, rank), use), shard(y, rank)).backward()
        nn.functional.mse_loss(engine(shard(x, rank), use), shard(y, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=not zero_in_place)
    return [p.detach().clone() for p in engine.module.parameters()]


def _against_torch(rank, world, zero_in_place, cap):
    torch.manual_seed(0)
    base = WithHead()
    ours = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=cap, find_unused_parameters=True)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap,
                                                 find_unused_parameters=True)
    out = []
    for m in (ours, theirs):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        out.append(_steps(m, opt, rank, world, zero_in_place))
    return out


@pytest.mark.parametrize("zero_in_place", [False, True])
def test_fused_scale_is_bitwise_torch_ddp_on_3_ranks(zero_in_place):
    """Fresh gradients (scaled in the copy), gradients accumulated in place (scaled at launch), a
    parameter unused on some steps (zeros): every bucket carries the 1/n once, as torch's. One
    parameter per bucket: torch keeps its first layout under find_unused_parameters, minddp
    rebuilds, and 3 ranks sum a bucket in an order that depends on its size."""
    for ours, theirs in launch.ranks(_against_torch, 3, zero_in_place, 1e-6, timeout=120):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), (a - b).abs().max()


def _optimizers(rank, world, kind, foreach):
    torch.manual_seed(0)
    base = MLP()
    options = {"lr": 1e-2, "weight_decay": 0.1, "foreach": foreach}
    if kind == "zero1":  # its reference: ZeRO-1 stepping all shards at once, as on the CPU (a
        # reduce-scatter sums in another order than an all-reduce)
        ref = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-6, shard_optimizer=True)
        ref_opt = minddp.ShardedOptimizer(ref, torch.optim.AdamW, **options)
        assert not ref_opt.gather_per_bucket
        eng = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-6, shard_optimizer=True)
        opt = minddp.ShardedOptimizer(eng, torch.optim.AdamW, **options)
        opt.gather_per_bucket = True  # what a GPU does (the CPU steps every shard at once)
    else:
        ref = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-6)
        ref_opt = minddp.ReplicatedOptimizer(ref, torch.optim.AdamW, **options)
        eng = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-6, optimizer_overlap=True)
        opt = minddp.OverlappedOptimizer(eng, torch.optim.AdamW, **options)
    sched = torch.optim.lr_scheduler.StepLR(opt.optim, step_size=2, gamma=0.5)  # lr read per step
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt.optim, step_size=2, gamma=0.5)
    for i in range(5):
        x, y = batch(i, world)
        for m, o, s in ((ref, ref_opt, ref_sched), (eng, opt, sched)):
            nn.functional.mse_loss(m(shard(x, rank)), shard(y, rank)).backward()
            o.step()
            o.zero_grad(set_to_none=True)
            s.step()
    opt.wait_params()
    ref_opt.wait_params()
    assert any(v for v in opt._steps[1]._lists.values()), "the functional per-bucket step never ran"
    return ([p.detach().clone() for p in ref.module.parameters()],
            [p.detach().clone() for p in eng.module.parameters()])


@pytest.mark.parametrize("kind", ["optimizer_overlap", "zero1"])
@pytest.mark.parametrize("foreach", [True, False])
def test_per_bucket_steps_are_bitwise_one_optimizer_step(kind, foreach):
    """One bucket at a time (the functional step on prebuilt lists after the first step), with an
    LR schedule: the same parameters as the whole optimizer stepping everything at once."""
    for ref, got in launch.ranks(_optimizers, 3, kind, foreach, timeout=120):
        for a, b in zip(ref, got):
            assert torch.equal(a, b), (a - b).abs().max()


def _works_handed_to_the_observer(rank, world, algorithm, hook):
    import torch.distributed as dist

    torch.manual_seed(0)
    ddp = minddp.DDP(MLP(), bucket_cap_mb=0.0001, algorithm=algorithm)
    if hook:
        ddp.register_comm_hook(None, lambda _, bucket: bucket.all_reduce(bucket.buffer()))
    seen, launched = [], ddp.observer.launched
    ddp.observer.launched = lambda b, started: (seen.append(started.work), launched(b, started))[1]
    x, y = batch(0, world)
    nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
    left = ddp.reducer.iteration  # what the started collectives lived on: dropped at the end
    return [type(w).__name__ if w is None else isinstance(w, dist.Work) for w in seen], left is None


@pytest.mark.parametrize("algorithm,hook,expected", [("native", False, True), ("ring", False, "NoneType"),
                                                     ("native", True, "NoneType")])
def test_the_observer_gets_the_native_collectives_own_work(algorithm, hook, expected):
    """CudaObserver orders its timing stream after the collective's own Work (its end event, no
    record of the bucket on that stream): the engine hands it over for the backend's all-reduce,
    not for the from-scratch algorithms or a hook, and the reducer keeps none past the step."""
    for works, none_left in launch.ranks(_works_handed_to_the_observer, 2, algorithm, hook):
        assert len(works) > 1 and set(works) == {expected}
        assert none_left
