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
    """Fresh gradients (landed per bucket), gradients accumulated in place, a parameter unused on
    some steps (zeros): every bucket carries the 1/n once, as torch's. One
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


class _Deep(nn.Module):
    def __init__(self, layers=40):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])

    def forward(self, x):
        return self.layers(x)


def _ops_per_backward(rank, world, set_to_none, engine, zero_after_forward=False):
    """The aten ops one forward and backward run, less the plain model's: what the engine adds."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    base = _Deep()
    models = {"plain": base, "minddp": minddp.DDP(copy.deepcopy(base)),
              "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(base))}
    m = models[engine]
    x = torch.randn(2, 4)
    counts = []
    for _ in range(3):  # the first two: minddp rebuilds its buckets after the first
        if not zero_after_forward:
            m.zero_grad(set_to_none=set_to_none)
        with Count() as c:
            loss = m(x).sum()
            if zero_after_forward:  # the tutorials' order: forward, zero_grad, backward
                m.zero_grad(set_to_none=set_to_none)
            loss.backward()
        counts.append(c.ops)
    return counts[-1], len(list(base.parameters()))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_engine_adds_a_constant_number_of_ops_per_bucket_not_per_gradient(set_to_none):
    """40 layers (80 gradients) in one bucket: what minddp adds to a forward and backward is a
    handful of aten ops per bucket (on the CPU, `.grad` None pointed at the bucket zeroed in
    one op; the 1/n, the collective, the usage flags), never one per gradient, as `.grad` set
    to None each step (zero_grad's default) would cost with a copy per parameter."""
    plain, n = launch.ranks(_ops_per_backward, 2, set_to_none, "plain", timeout=120)[0]
    ours, _ = launch.ranks(_ops_per_backward, 2, set_to_none, "minddp", timeout=120)[0]
    added = len(ours) - len(plain)
    assert added <= 12, (added, sorted(set(ours) - set(plain)), n)
    assert "aten._foreach_copy_.default" not in ours  # autograd accumulated into the bucket
    flags = 1  # every parameter used here: the usage flags are zeros
    assert ours.count("aten.zero_.default") == flags + (1 if set_to_none else 0), ours


def test_gradients_made_after_the_forward_land_with_one_copy_per_bucket():
    """`.grad` set to None between the forward and the backward (or on a device with fused
    foreach kernels, where they always do): autograd makes fresh gradients, and they land in
    the bucket with one `_foreach_copy_`, still a handful of ops per bucket."""
    plain, n = launch.ranks(_ops_per_backward, 2, True, "plain", True, timeout=120)[0]
    ours, _ = launch.ranks(_ops_per_backward, 2, True, "minddp", True, timeout=120)[0]
    assert len(ours) - len(plain) <= 12, (len(ours) - len(plain), sorted(set(ours) - set(plain)), n)
    assert ours.count("aten._foreach_copy_.default") == 1, ours
