"""The engine against torch DDP and single-process training, on real gloo processes."""


import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

import minddp
from tests import launch
from tests.models import MLP, B, WithBN, assert_same_params, batch, params_of, shard

STEPS = 4


def train(model, steps, rank, world_size, full_batch=False, momentum=0.9, accum=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            x, y = batch(step * accum + micro, world_size)
            if not full_batch:
                x, y = shard(x, rank), shard(y, rank)
            last = micro == accum - 1
            ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else _null()
            with ctx:
                loss = nn.functional.mse_loss(model(x), y) / accum
                loss.backward()
        opt.step()
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---------------------------------------------------------------- equivalence
def _equivalence(rank, world_size, cap_mb, overlap):
    torch.manual_seed(0)
    base = MLP()
    ours = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=cap_mb, overlap=overlap)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap_mb)
    train(ours, STEPS, rank, world_size)
    train(theirs, STEPS, rank, world_size)
    single = train(copy.deepcopy(base), STEPS, rank, world_size, full_batch=True)
    assert_same_params(params_of(ours), params_of(theirs))
    assert_same_params(params_of(ours), params_of(single))
    stats = ours.comm_stats
    assert stats.num_collectives == len(ours.bucket_assignment) == stats.num_buckets
    # on the wire: every gradient in fp32, plus one usage flag per parameter in the last bucket
    n_params = len(list(base.parameters()))
    assert stats.bytes == sum(p.numel() * 4 for p in base.parameters()) + 4 * n_params
    return len(ours.bucket_assignment)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: make test
@pytest.mark.parametrize("cap_mb", [1e-6, 0.002, 1000.0])
def test_matches_torch_ddp_and_single_process(world_size, cap_mb):
    nbuckets = launch.ranks(_equivalence, world_size, cap_mb, True)
    n_params = len(list(MLP().parameters()))
    expected = {1e-6: n_params, 1000.0: 1}.get(cap_mb)
    if expected is not None:
        assert nbuckets == [expected] * world_size
    else:
        assert all(1 < n < n_params for n in nbuckets)


def test_overlap_false_gives_same_result():
    launch.ranks(_equivalence, 2, 0.002, False)


# -------------------------------------------------------------------- overlap
class Deep(nn.Module):
    """Enough work in backward that early buckets finish while later layers still compute."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _overlap(rank, world_size, overlap):
    torch.manual_seed(0)
    model = minddp.DDP(Deep(), bucket_cap_mb=0.3, overlap=overlap)
    x = torch.randn(64, 256)
    for _ in range(3):
        model(x).square().mean().backward()
    s = model.comm_stats
    return s.num_buckets, s.launched_in_backward, s.launch_order


def test_buckets_launch_during_backward_in_bucket_order():
    for nb, in_backward, order in launch.ranks(_overlap, 2, True):
        assert nb >= 4
        assert order == list(range(nb))
        # every bucket but those holding the last-ready gradients went out from a
        # hook, i.e. while autograd was still computing earlier layers
        assert in_backward == nb


def test_overlap_false_defers_every_bucket_to_the_end():
    for nb, in_backward, order in launch.ranks(_overlap, 2, False):
        assert in_backward == 0 and order == list(range(nb))


class Reversed(nn.Module):
    """Registered in the opposite order of use: the ready order differs from the
    reverse registration order, so buckets must be rebuilt to overlap well."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(16, 4)
        self.early = nn.Linear(8, 16)

    def forward(self, x):
        return self.late(torch.tanh(self.early(x)))


def _rebuild(rank, world_size):
    torch.manual_seed(0)
    model = minddp.DDP(Reversed(), bucket_cap_mb=1e-6)
    before = model.bucket_assignment
    x = torch.randn(4, 8)
    launch_orders = []
    for _ in range(3):
        model(x).sum().backward()
        launch_orders.append(model.comm_stats.launched_in_backward)
    return before, model.bucket_assignment, launch_orders


def test_buckets_rebuilt_once_in_observed_ready_order():
    results = launch.ranks(_rebuild, 2)
    for before, after, _ in results:
        assert before[0] == ["early.bias"]  # reverse registration order
        assert after[0] == ["late.bias"] or after[0] == ["late.weight"]
        assert {n for b in after for n in b} == {n for b in before for n in b}
    assert results[0][1] == results[1][1]  # every rank agrees on the plan
    for *_, launched in results:
        assert launched[-1] == 4  # after the rebuild, every bucket launches from a hook


def _callbacks(rank, world_size):
    model = minddp.DDP(Reversed(), bucket_cap_mb=1e-6)
    reduced, rebuilt = [], []
    model.on_reduced(lambda b: reduced.append((b, model.layout.buckets[b].buffer.clone())))
    model.on_rebuild(lambda layout: rebuilt.append(layout.version))
    for _ in range(2):
        model(torch.randn(4, 8) + rank).sum().backward()  # each rank its own gradient
    return reduced, rebuilt, model.layout_version


def test_engine_callbacks_run_in_bucket_order_after_each_wait_and_once_before_the_rebuild():
    (ours, rebuilt, version), (theirs, *_) = launch.ranks(_callbacks, 2)
    assert [b for b, _ in ours] == [b for b, _ in theirs] == list(range(4)) * 2  # in bucket order
    for (_, a), (_, b) in zip(ours, theirs):  # after its wait: the average, the same on both ranks
        assert torch.equal(a, b)
    assert rebuilt == [1] and version == 2  # the old layout, once


# ------------------------------------------------------------------- no_sync
def _no_sync(rank, world_size):
    torch.manual_seed(0)
    base = MLP()
    ours = train(minddp.DDP(copy.deepcopy(base), bucket_cap_mb=0.002), 3, rank, world_size,
                 accum=3)
    # the reference: one process, each step's three micro-batches concatenated
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        xs, ys = zip(*(batch(step * 3 + m, world_size) for m in range(3)))
        loss = nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        opt.step()
    assert_same_params(params_of(ours), params_of(ref))


def test_no_sync_accumulation_equals_big_batch():
    launch.ranks(_no_sync, 2)


# -------------------------------------------------------- unused parameters
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)

    def forward(self, x, use_b=True):
        h = torch.tanh(self.body(x))
        out = self.head_a(h)
        return out + self.head_b(h) if use_b else out


def _unused_error(rank, world_size):
    model = minddp.DDP(TwoHeads())
    x = torch.randn(4, 8)
    model(x, use_b=(rank != 1)).sum().backward()  # head_b unused on rank 1 only
    # backward returns without a host sync: the flags are read by the next forward (torch's place)
    assert model.module.head_a.weight.grad is not None
    model(x)


def test_unused_parameter_raises_on_every_rank_naming_it():
    errors = launch.ranks_expect_errors(_unused_error, 2, timeout=60)
    for text in errors.values():
        assert "head_b.weight" in text and "head_b.bias" in text
        assert "find_unused_parameters=True" in text


def _find_unused(rank, world_size):
    torch.manual_seed(0)
    base = TwoHeads()
    ours = minddp.DDP(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=1e-6)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
    results = []
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step, world_size)
            # head_b: used by rank 0 only on even steps, by nobody on odd steps
            use_b = rank == 0 and step % 2 == 0
            nn.functional.mse_loss(model(shard(x, rank), use_b=use_b), shard(y, rank)).backward()
            grads = {n: (p.grad is None) for n, p in model.module.named_parameters()}
            opt.step()
        results.append((params_of(model), grads))
    assert_same_params(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]  # same .grad is None pattern (globally unused)
    assert results[0][1]["head_b.weight"] is True


def test_find_unused_parameters_matches_torch_ddp():
    launch.ranks(_find_unused, 2)


# ------------------------------------------- tied, frozen, mixed dtypes, buffers
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.extra = nn.Linear(8, 8).double()
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, idx):
        h = torch.tanh(self.mid(self.emb(idx)))
        h = self.frozen(h) + self.extra(h.double()).float()
        return self.out(h)


def _tied_frozen_mixed(rank, world_size):
    torch.manual_seed(0)
    base = Tied()
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, 10, (world_size * B, 5), generator=g)
    models = [minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-4),
              nn.parallel.DistributedDataParallel(copy.deepcopy(base)), copy.deepcopy(base)]
    for k, model in enumerate(models):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            data = idx if k == 2 else shard(idx, rank)
            logits = model(data)
            nn.functional.cross_entropy(logits.flatten(0, 1), data.flatten()).backward()
            opt.step()
    ours, theirs, single = (params_of(m) for m in models)
    assert "out.weight" not in ours  # the tied weight is one parameter, reduced once
    assert models[0].module.out.weight is models[0].module.emb.weight
    assert_same_params(ours, theirs)
    assert_same_params(ours, single)
    assert_close(ours["frozen.weight"], base.frozen.weight)  # frozen stays frozen
    assert ours["extra.weight"].dtype == torch.float64
    assert {len({p.dtype for p in b}) for b in _bucket_params(models[0])} == {1}


def _bucket_params(model):
    params = dict(model.module.named_parameters())
    return [[params[n] for n in b] for b in model.bucket_assignment]


def test_tied_frozen_and_mixed_dtype_parameters():
    launch.ranks(_tied_frozen_mixed, 2)


def _buffers(rank, world_size, broadcast_buffers):
    torch.manual_seed(0)
    base = WithBN()
    ours = minddp.DDP(copy.deepcopy(base), broadcast_buffers=broadcast_buffers)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                 broadcast_buffers=broadcast_buffers)
    for model in (ours, theirs):
        train(model, STEPS, rank, world_size, accum=2)
    a, b = ours.module.state_dict(), theirs.module.state_dict()
    for k in a:
        assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    return ours.module.bn.running_mean.clone()


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_broadcast_like_torch_ddp(broadcast_buffers):
    means = launch.ranks(_buffers, 2, broadcast_buffers)
    # the last forward broadcast rank 0's statistics, then each rank updated its own
    assert not torch.equal(means[0], means[1])


def _init_broadcast(rank, world_size):
    torch.manual_seed(rank)  # every rank starts from different weights
    model = MLP()
    model.register_buffer("counter", torch.full((3,), float(rank)))
    ddp = minddp.DDP(model)
    flat = torch.cat([p.detach().flatten() for p in ddp.parameters()] + [model.counter])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    torch.manual_seed(0)
    expected = torch.cat([p.detach().flatten() for p in MLP().parameters()] + [torch.zeros(3)])
    return all(torch.equal(e, expected) for e in everyone)


def test_initial_parameters_and_buffers_broadcast_from_first_rank():
    assert launch.ranks(_init_broadcast, 3) == [True] * 3


# ----------------------------------------------- model mismatch, no hang
def _mismatch(rank, world_size):
    width = 32 if rank == 0 else 16
    minddp.DDP(MLP(width=width))


def test_model_mismatch_raises_on_every_rank():
    errors = launch.ranks_expect_errors(_mismatch, 3, timeout=60)
    for text in errors.values():
        assert "differs across ranks" in text
        assert "layers.0.weight" in text and "[32, 8]" in text and "[16, 8]" in text


def _extra_param(rank, world_size):
    model = MLP()
    if rank == 1:
        model.extra = nn.Linear(2, 2)
    minddp.DDP(model)


def test_extra_parameter_on_one_rank_raises_on_every_rank():
    errors = launch.ranks_expect_errors(_extra_param, 2, timeout=60)
    for text in errors.values():
        assert "extra.weight" in text


# --------------------------------------------- reduce ops, compression, hooks
def _reduce_sum(rank, world_size):
    torch.manual_seed(0)
    model = minddp.DDP(MLP(), reduce_op="sum")
    ref = minddp.DDP(copy.deepcopy(model.module))
    x, y = batch(0, world_size)
    for m in (model, ref):
        nn.functional.mse_loss(m(shard(x, rank)), shard(y, rank)).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad * world_size)


def test_reduce_op_sum():
    launch.ranks(_reduce_sum, 3)


def _compress(rank, world_size, compress):
    torch.manual_seed(0)
    base = MLP()
    ours = train(minddp.DDP(copy.deepcopy(base), compress=compress, bucket_cap_mb=0.002),
                 STEPS, rank, world_size)
    exact = train(copy.deepcopy(base), STEPS, rank, world_size, full_batch=True)
    a, b = params_of(ours), params_of(exact)
    for n in a:
        assert a[n].dtype == torch.float32
        assert_close(a[n], b[n], atol=2e-2, rtol=2e-2)
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("compress", ["fp16", "bf16"])
def test_16_bit_compression_trains_on_gloo(compress):
    errs = launch.ranks(_compress, 2, compress)
    assert 0 < errs[0] < 2e-2  # compressed, so not bit-identical, but close


def _custom_hook(rank, world_size):
    calls = []

    def hook(state, bucket):
        state.append((bucket.index(), bucket.is_last(), len(bucket.parameters())))
        return bucket.all_reduce(bucket.buffer())

    model = minddp.DDP(MLP(), bucket_cap_mb=1e-6)
    model.register_comm_hook(calls, hook)
    model(torch.randn(2, 8)).sum().backward()
    n = len(model.bucket_assignment)
    assert [c[0] for c in calls] == list(range(n))
    assert [c[1] for c in calls] == [False] * (n - 1) + [True]


def test_register_comm_hook():
    launch.ranks(_custom_hook, 2)


# ---------------------------------------------------------------- sub-groups
def _subgroup(rank, world_size):
    group = dist.new_group([1, 2])  # every rank calls new_group
    if rank == 0:
        return None
    torch.manual_seed(rank)  # ranks 1 and 2 start differently: rank 1 (global) wins
    model = minddp.DDP(nn.Linear(4, 1, bias=False), process_group=group)
    torch.manual_seed(1)
    expected_init = nn.Linear(4, 1, bias=False).weight.detach().clone()
    assert torch.equal(model.module.weight.detach(), expected_init)
    x = torch.full((1, 4), float(rank))
    model(x).sum().backward()
    return model.module.weight.grad.clone()


def test_process_group_reduces_over_the_subgroup_only():
    _, g1, g2 = launch.ranks(_subgroup, 3)
    assert torch.equal(g1, g2) and torch.equal(g1, torch.full((1, 4), 1.5))


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        minddp.DDP(nn.Linear(2, 2))


# ------------------------------------------------- from-scratch algorithms
def _algorithms(rank, world_size):
    torch.manual_seed(0)
    base = MLP()
    native = train(minddp.DDP(copy.deepcopy(base), bucket_cap_mb=0.002), STEPS, rank, world_size)
    for algorithm in ("ring", "rs_ag", "tree", "hierarchical"):
        model = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=0.002, algorithm=algorithm,
                           ranks_per_node=2)
        train(model, STEPS, rank, world_size)
        assert model.comm_stats.num_collectives == len(model.bucket_assignment) > 1
        assert_same_params(params_of(model), params_of(native))


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: make test
def test_every_algorithm_trains_like_native(world_size):
    launch.ranks(_algorithms, world_size)


# ------------------------------------------------------------ uneven inputs
def _uneven(rank, world_size, divide):
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(0)
    base = WithBN()
    n_batches = 2 + 2 * rank  # rank 0 runs out first
    results = []
    for kind in ("ours", "torch"):
        if kind == "ours":
            model = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-3)
            ctx = model.join(divide_by_initial_world_size=divide)
        else:
            model = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3)
            ctx = Join([model], divide_by_initial_world_size=divide)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ctx:
            for step in range(n_batches):
                x, y = batch(step, world_size)
                opt.zero_grad()
                nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
                opt.step()
        results.append(model.module.state_dict())
        if kind == "ours":  # shadowing (rank 0) or training, no Work outlives the step
            assert model.reducer.iteration is None  # what the started collectives lived on
    for k in results[0]:
        assert_close(results[0][k], results[1][k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    return results[0]["fc.weight"]


@pytest.mark.parametrize("divide", [True, False])
def test_join_uneven_inputs_matches_torch_join(divide):
    w = launch.ranks(_uneven, 3, divide, timeout=90)
    assert torch.equal(w[0], w[1]) and torch.equal(w[1], w[2])  # everyone ends with the same model


def _avg_like_torch(rank, world_size):
    """torch DDP averages by multiplying each gradient by 1/world size, then summing. With the
    same batch on every rank the addends are equal, so any summation order gives the same bits,
    and 3 * fl(g * fl(1/3)) differs from AVG's fl(3g / 3) = g in the last bits."""
    torch.manual_seed(0)
    base = MLP()
    ours = minddp.DDP(copy.deepcopy(base))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    x, y = batch(0, world_size)
    for model in (ours, theirs):
        nn.functional.mse_loss(model(x), y).backward()
    for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
        assert torch.equal(a.grad, b.grad), name
    single = copy.deepcopy(base)
    nn.functional.mse_loss(single(x), y).backward()
    assert not all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), single.parameters()))


def test_average_is_pre_divide_then_sum_bitwise_as_torch_ddp():
    launch.ranks(_avg_like_torch, 3)


# ------------------------------------------------------- optimizer overlap
def _overlap_step(rank, world_size, opt_name):
    torch.manual_seed(0)
    base = MLP(width=37, depth=4)
    decay = lambda m: [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},  # noqa: E731
                       {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    cls, kw = {"adamw": (torch.optim.AdamW, {"lr": 1e-2}),
               "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}[opt_name]
    runs = []
    for overlapped in (False, True):
        ddp = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=0.002, optimizer_overlap=overlapped)
        if overlapped:
            opt = minddp.OverlappedOptimizer(ddp, cls, decay(ddp.module), **kw)
        else:
            opt = cls(decay(ddp.module), **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(getattr(opt, "optim", opt), lambda s: 1.0 / (1 + s))
        steps = []
        for step in range(4):
            for micro in range(2):  # accumulation: only the synchronised backward steps
                ddp.require_backward_grad_sync = micro == 1
                x, y = batch(2 * step + micro, world_size)
                nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
            if overlapped:
                assert opt.steps_taken == len(ddp.bucket_assignment) > 1  # one step per bucket, in backward
            steps.append(ddp.grad_norm())
            opt.step()
            sched.step()
            opt.zero_grad()
        runs.append((params_of(ddp), steps, opt.state_dict()))
    (ref, ref_norms, ref_state), (got, norms, state) = runs
    for n in ref:  # exactly the ordinary step
        assert torch.equal(got[n], ref[n]), n
    assert all(torch.equal(a, b) for a, b in zip(norms, ref_norms))
    for k, st in ref_state["state"].items():
        for key, v in st.items():
            assert torch.equal(state["state"][k][key], v), (k, key)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ does not combine with optimizer_overlap"):
        ddp.clip_grad_norm_(1.0)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: make test
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_optimizer_overlap_equals_the_ordinary_step(world_size, opt_name):
    launch.ranks(_overlap_step, world_size, opt_name, timeout=120)


def test_optimizer_overlap_refuses_what_it_cannot_keep_exact():
    def check(rank, world_size):
        with pytest.raises(ValueError, match="optimizer_overlap does not combine with shard_optimizer"):
            minddp.DDP(MLP(), shard_optimizer=True, optimizer_overlap=True)
        with pytest.raises(ValueError, match="does not combine with find_unused_parameters"):
            minddp.DDP(MLP(), find_unused_parameters=True, optimizer_overlap=True)
        with pytest.raises(ValueError, match="optimizer_overlap=True"):
            minddp.OverlappedOptimizer(minddp.DDP(MLP()), torch.optim.SGD, lr=0.1)

    launch.ranks(check, 2)
