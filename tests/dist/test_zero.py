"""ZeRO-1 (minddp.ShardedOptimizer) against the unsharded engine, on real gloo processes."""


import copy

import pytest
import torch
from torch import nn

import minddp
from tests import launch
from tests.models import MLP, assert_same_params, batch, params_of, shard

# ----------------------------------------------------------- through train.py


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


def _train(rank, world_size, sharded, opt_name, steps=4, accum=2, clip=0.5):
    torch.manual_seed(0)
    base = MLP(width=37, depth=3)  # odd sizes: shards split parameters unevenly
    ddp = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=0.002, shard_optimizer=sharded)
    cls, kw = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
               "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}[opt_name]
    if sharded:
        opt = minddp.ShardedOptimizer(ddp, cls, _groups(ddp.module), **kw)
    else:
        opt = cls(_groups(ddp.module), **kw)
    for step in range(steps):
        for micro in range(accum):
            ddp.require_backward_grad_sync = micro == accum - 1
            x, y = batch(step * accum + micro, world_size)
            (nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)) / accum).backward()
        norm = opt.clip_grad_norm_(clip) if sharded else ddp.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    if sharded:
        opt.wait_params()
    return params_of(ddp), float(norm), opt.state_dict()


def _equivalence(rank, world_size, opt_name):
    ref, ref_norm, ref_state = _train(rank, world_size, False, opt_name)
    got, norm, state = _train(rank, world_size, True, opt_name)
    assert_same_params(got, ref, atol=1e-5, rtol=1e-5)
    assert abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm)
    # the sharded optimizer's state dict is the unsharded one's: same keys, same tensors
    assert ref_state["state"].keys() == state["state"].keys()
    for k in ref_state["state"]:
        for key, v in ref_state["state"][k].items():
            torch.testing.assert_close(state["state"][k][key].float(), v.float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_sharded_optimizer_equals_unsharded(world_size, opt_name):
    launch.ranks(_equivalence, world_size, opt_name, timeout=120)


def _memory(rank, world_size):
    _, _, _ = _train(rank, world_size, True, "adamw", steps=1, accum=1)
    torch.manual_seed(0)
    ddp = minddp.DDP(MLP(width=64, depth=4), bucket_cap_mb=0.002, shard_optimizer=True)
    opt = minddp.ShardedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    x, y = batch(0, world_size)
    nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
    opt.step()
    full = 2 * 4 * sum(p.numel() for p in ddp.module.parameters())  # exp_avg + exp_avg_sq, fp32
    return opt.state_bytes(), full


def test_optimizer_state_per_rank_is_one_over_dp():
    results = launch.ranks(_memory, 2)
    full = results[0][1]
    for mine, _ in results:
        assert abs(mine - full / 2) <= 0.05 * full / 2 + 64, (mine, full)  # + the step scalars
    assert sum(m for m, _ in results) == pytest.approx(full, abs=64)


def test_bad_combinations_name_the_alternative():
    import torch.distributed as dist

    def check(rank, world_size):
        for kwargs, message in [({"compress": "bf16"}, "does not combine with compress"),
                                ({"algorithm": "ring"}, "use algorithm='native'"),
                                ({"find_unused_parameters": True}, "freeze unused parameters")]:
            with pytest.raises(ValueError, match=message):
                minddp.DDP(MLP(), shard_optimizer=True, **kwargs)
        with pytest.raises(ValueError, match="shard_optimizer=True"):
            minddp.ShardedOptimizer(minddp.DDP(MLP()), torch.optim.AdamW)
        assert dist.is_initialized()

    launch.ranks(check, 2)


class _UsedBackwards(nn.Module):
    """Layers used in the reverse of their registration order: the first backward's ready
    order differs from the initial buckets', so the engine rebuilds them."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _rebuild_releases(rank, world_size, sharded):
    import gc
    import weakref

    torch.manual_seed(0)
    ddp = minddp.DDP(_UsedBackwards(), bucket_cap_mb=1e-4, shard_optimizer=sharded)
    if sharded:
        opt = minddp.ShardedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    old = ddp.layout
    refs = [weakref.ref(t) for t in [*(old.flat_params or ()), *(b.buffer for b in old.buckets)]]
    old_buckets = [weakref.ref(b) for b in old.buckets]
    del old
    import minddp.engine.reducer as engine  # where the reducer builds its layouts

    alive_at_rebuild, real_build = [], engine.Layout.build

    def spy(*args, **kwargs):  # the new layout is being built: the old one must be gone already,
        gc.collect()  # but for the gradients still in its buffers (each goes once moved)
        alive_at_rebuild.append(sum(r() is not None for r in old_buckets))
        return real_build(*args, **kwargs)

    engine.Layout.build = spy
    x = torch.randn(4, 8)
    try:
        ddp(x).square().mean().backward()
    finally:
        engine.Layout.build = real_build
    assert alive_at_rebuild == [0], alive_at_rebuild  # (a live bucket would keep its whole buffer)
    assert ddp.layout_version == 2  # rebuilt in the observed order
    gc.collect()  # (a reference cycle elsewhere in the process may hold one until the next collection)
    # nothing (engine, reduction, optimizer) kept the old flat parameters or gradient buffers
    assert all(r() is None for r in refs), sum(r() is not None for r in refs)
    opt.step()
    if sharded:
        opt.wait_params()
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


@pytest.mark.parametrize("sharded", [False, True])
def test_rebuild_keeps_no_second_copy_of_parameters_or_gradients(sharded):
    a, b = launch.ranks(_rebuild_releases, 2, sharded)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _traced_step(rank, world_size):
    from minddp.train.metrics.steptrace import StepTrace

    torch.manual_seed(0)
    ddp = minddp.DDP(MLP(width=64, depth=4), bucket_cap_mb=0.01, shard_optimizer=True)
    opt = minddp.ShardedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    x, y = batch(0, world_size)
    for _ in range(2):  # the first step rebuilds the buckets
        nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    tr = StepTrace(ddp)
    tr.start()
    nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()  # waits for the gathers
    opt.step()  # launches the next ones (recorded too: launched, not yet waited for)
    trace, waited = tr.stop(), opt.exposed_gather_s
    opt.zero_grad()
    return {"comm": trace["comm"], "exposed": [s for s in trace["compute"] if s[0] == "exposed all-gather"],
            "waited": waited, "buckets": len(ddp.layout.buckets)}


def test_all_gathers_are_traced_and_their_exposed_wait_measured():
    for got in launch.ranks(_traced_step, 2):
        gathers = [(n, s, e) for n, s, e in got["comm"] if n.startswith("all-gather")]
        assert all(0 <= s <= e for _, s, e in gathers)
        before = [g for g in gathers if g[1] == 0]  # launched by the step before the trace started
        assert len(before) == len(gathers) - len(before) == got["buckets"] > 1  # and by the traced one
        assert sum(n.startswith("bucket") for n, _, _ in got["comm"]) == got["buckets"]  # reduce-scatters
        # the forward's waits for the previous step's gathers: drawn as exposed, and what the
        # optimizer reports for the step (comm/exposed_gather_s in the trainer's metrics)
        assert got["waited"] == pytest.approx(sum(e - s for _, s, e in got["exposed"]), abs=1e-3)


def _join_uneven(rank, world_size):
    torch.manual_seed(0)
    ddp = minddp.DDP(MLP(), bucket_cap_mb=0.002, shard_optimizer=True)
    opt = minddp.ShardedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="register_comm_hook does not combine with shard_optimizer"):
        ddp.register_comm_hook(None, minddp.allreduce_hook)
    with ddp.join():  # refused here, on every rank, before any collective (no hang, no gloo abort)
        for step in range(2 + rank):  # uneven: rank 1 has one batch more
            x, y = batch(step, world_size)
            nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
            opt.step()
            opt.zero_grad()


def test_join_with_uneven_inputs_is_refused_naming_both():
    errors = launch.ranks_expect_errors(_join_uneven, 2, timeout=60)
    for text in errors.values():
        assert "join() does not combine with shard_optimizer=True" in text, text
        assert "RuntimeError" in text and "ShardedOptimizer" in text
