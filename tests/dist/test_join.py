"""join()'s torch arguments (issue 34 item 7): `enable` and `throw_on_early_termination`, each
against torch DDP's own `join()` on the same script, on 2 and 3 real gloo ranks.
(`divide_by_initial_world_size` is test_ddp.py::test_join_uneven_inputs_matches_torch_join.)"""


import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.testing import assert_close

import minddp
from tests import launch
from tests.models import batch, shard


class WithOwnCollective(nn.Module):
    """A model with a collective of its own in forward (SyncBatchNorm's situation): a joined rank
    cannot shadow it, which is what throw_on_early_termination is for."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        mean = h.detach().mean(0)
        dist.all_reduce(mean)  # every rank, every forward
        return self.out(h - mean / dist.get_world_size())


def _wrap(kind, base):
    if kind == "ours":
        return minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-3)
    return nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3)


def _step(model, opt, step, rank, world_size):
    x, y = batch(step, world_size)
    opt.zero_grad()
    nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    opt.step()


def _throw(rank, world_size):
    torch.manual_seed(0)
    base = WithOwnCollective()
    n_batches = 3 + 2 * rank  # rank 0 runs out first; the others at different steps
    seen = {}
    for kind in ("ours", "torch"):
        model = _wrap(kind, base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        done, error = 0, None
        try:
            with model.join(throw_on_early_termination=True):
                for step in range(n_batches):
                    _step(model, opt, step, rank, world_size)
                    done += 1
        except RuntimeError as e:
            error = str(e)
        # the wrapper is still usable: one more even step on every rank
        _step(model, opt, 100, rank, world_size)
        seen[kind] = (done, error, {k: v.clone() for k, v in model.module.state_dict().items()})
    (done, error, ours), (t_done, t_error, theirs) = seen["ours"], seen["torch"]
    assert (done, error) == (t_done, t_error)
    for k in ours:
        assert_close(ours[k], theirs[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    return done, error, ours["fc.weight"]


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: make test
def test_join_throw_on_early_termination_raises_on_every_rank_like_torch(world_size):
    out = launch.ranks(_throw, world_size, timeout=90)
    assert out[0][:2] == (3, "Rank 0 exhausted all inputs.")
    others = "Detected at least one rank that exhausted inputs. Throwing across all ranks."
    for done, error, _ in out[1:]:
        assert (done, error) == (3, others)
    assert all(torch.equal(out[0][2], w) for _, _, w in out[1:])  # the replicas never diverged


def _throw_all_at_once(rank, world_size):
    """Every rank runs out at the same step: nobody raises, as in torch (its post-hook runs)."""
    torch.manual_seed(0)
    base = WithOwnCollective()
    params = {}
    for kind in ("ours", "torch"):
        model = _wrap(kind, base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join(throw_on_early_termination=True):
            for step in range(3):
                _step(model, opt, step, rank, world_size)
        params[kind] = model.module.fc.weight.detach().clone()
    assert_close(params["ours"], params["torch"], atol=1e-6, rtol=1e-5)


def test_join_throw_with_even_inputs_does_not_raise():
    launch.ranks(_throw_all_at_once, 2)


def _collectives(model, opt, rank, world_size, steps):
    """The collectives the profiler saw during `steps` training steps (gloo records each)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(steps):
            _step(model, opt, step, rank, world_size)
    return sum(1 for e in prof.events() if e.name.startswith("gloo:"))


def _disabled(rank, world_size):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    out = {}
    for kind in ("ours", "torch"):
        counts = []
        for enable in (True, False, None):  # None: no join() at all
            model = _wrap(kind, base)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            _step(model, opt, 0, rank, world_size)  # the first step (bucket rebuild) outside
            ctx = model.join(enable=enable) if enable is not None else _null()
            with ctx:
                counts.append(_collectives(model, opt, rank, world_size, 3))
            out[kind, enable] = model.module[0].weight.detach().clone()
        # enabled: one more collective per forward; disabled: exactly what no join() issues
        assert counts[0] > counts[2] and counts[1] == counts[2], (kind, counts)
    for key in out:
        assert_close(out[key], out["torch", None], atol=1e-6, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: make test
def test_join_enable_false_is_a_no_op_like_torch(world_size):
    launch.ranks(_disabled, world_size, timeout=90)


def _disabled_sharded(rank, world_size):
    """enable=False asks for nothing: it combines with shard_optimizer (which join() refuses)."""
    model = minddp.DDP(nn.Linear(8, 4), shard_optimizer=True)
    with model.join(enable=False):
        model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="does not combine with shard_optimizer"):
        with model.join():
            pass


def test_join_enable_false_combines_with_shard_optimizer():
    launch.ranks(_disabled_sharded, 2)
