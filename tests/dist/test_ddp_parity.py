"""minddp.DDP and torch DDP on the same script, one test (at least) per difference torch 2.13's own
DDP tests found; torch's behaviour is the contract. Each script runs with both wrappers on real
gloo ranks (2, or 3 where the rule depends on the count) and compares gradients, parameters,
buffers, warnings and error types."""


import contextlib
import copy
import inspect
import io
import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

import minddp
from minddp.engine import transfer
from minddp.engine.buckets import MiB, TensorSpec, assign_buckets
from minddp.engine.usage import MAX_DEFER, UsageFlags
from tests import launch
from tests.models import MLP, WithBN, assert_same_params, batch, params_of, shard

TORCH_DDP = nn.parallel.DistributedDataParallel


WRAPPERS = (minddp.DDP, TORCH_DDP)


def _grads(model) -> dict:
    m = getattr(model, "module", model)
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in m.named_parameters()}


def _assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert (a[n] is None) == (b[n] is None), f"{n}: {a[n]} vs {b[n]}"
        if a[n] is not None:
            assert_close(a[n], b[n], atol=1e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def _everyone(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of t."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.detach().contiguous())
    return out


def _same_everywhere(named: dict) -> None:
    for n, t in named.items():
        for other in _everyone(t):
            assert torch.equal(other, t), f"{n} differs across ranks"


def _sgd_steps(model, rank, world_size, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in steps:
        x, y = batch(step, world_size)
        nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


# ---------------- 1. a parameter used only in a no_sync() micro-step is used (find_unused_parameters)
class Conditional(nn.Module):
    """torch's test_grads_same_across_ranks_with_no_sync model: rank 0 uses nn1 then nn2 on
    alternate forwards, every other rank nn3 then nn4."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.nn1, self.nn2, self.nn3, self.nn4 = (nn.Linear(1, 1) for _ in range(4))
        self.state = 0

    def forward(self, x):
        first, self.state = self.state == 0, 1 - self.state
        if self.rank == 0:
            return (self.nn1 if first else self.nn2)(x)
        return (self.nn3 if first else self.nn4)(x)


def _no_sync_usage(rank, world_size):
    runs = []
    for cls in WRAPPERS:
        torch.manual_seed(0)
        model = cls(Conditional(rank), find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        grads = []
        for _ in range(3):
            for micro in range(2):  # the first micro-step under no_sync(), as torch's test
                with model.no_sync() if micro == 0 else contextlib.nullcontext():
                    x, y = torch.rand(1, generator=g), torch.rand(1, generator=g)
                    nn.functional.mse_loss(model(x), y).backward()
            grads.append(_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((grads, params_of(model)))
    (ours, ours_params), (theirs, theirs_params) = runs
    for a, b in zip(ours, theirs):
        _assert_same_grads(a, b)
    assert_same_params(ours_params, theirs_params)
    _same_everywhere(ours_params)  # the replicas never diverge
    _same_everywhere({n: g for n, g in ours[-1].items() if g is not None})
    return {n: g is None for n, g in ours[-1].items()}


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: make test
def test_grads_same_across_ranks_with_no_sync_and_find_unused_parameters(world_size):
    for nones in launch.ranks(_no_sync_usage, world_size):
        assert not any(nones.values())  # every layer was used by some rank in some micro-step


# ---------------------------------------- 2. a reassigned buffer is broadcast (pytorch#63916)
class NetWithBuffers(nn.Module):
    """torch's test_ddp_broadcast_buffer model."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 1, bias=False)
        self.register_buffer("buffer", torch.randn(1, 2))

    def forward(self, x):
        return self.b(self.a(x))


def _reassigned_buffer(rank, world_size):
    seen = []
    for cls in WRAPPERS:
        torch.manual_seed(rank)
        model = cls(NetWithBuffers())
        inp = torch.randn(2, 10)
        values = []
        for _ in range(3):
            if rank == 0:
                model.module.buffer = model.module.buffer + 1  # a new tensor, not in place
            model(inp).sum().backward()
            _same_everywhere({"buffer": model.module.buffer})
            values.append(model.module.buffer.clone())
        seen.append(values)
    for a, b in zip(*seen):
        assert_close(a, b)


def test_reassigned_buffer_is_broadcast_at_each_forward():
    launch.ranks(_reassigned_buffer, 2)


# ------------------------------------ 3. broadcast_buffers=False leaves buffers out of init sync
def _init_sync_buffers(rank, world_size):
    seen = {}
    for kwargs in ({"broadcast_buffers": False}, {"broadcast_buffers": True}, {"forward_sync_buffers": False},
                   {}, {"init_sync": False}):
        got = []
        for cls in WRAPPERS:
            torch.manual_seed(0)
            model = MLP()
            model.register_buffer("local", torch.full((3,), float(rank)))  # rank-local, e.g. a counter
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                ddp = cls(model, **kwargs)
            at_init = torch.stack(_everyone(ddp.module.local))[:, 0]
            if rank == 1:
                ddp.module.local += 10  # only the forward's broadcast can undo this
            x, y = batch(0, world_size)
            nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
            got.append((at_init, torch.stack(_everyone(ddp.module.local))[:, 0], params_of(ddp)))
        (a0, a1, ap), (b0, b1, bp) = got
        assert_close(a0, b0)
        assert_close(a1, b1)
        assert_same_params(ap, bp)
        seen[str(kwargs)] = a0.tolist(), a1.tolist()
    return seen


def test_broadcast_buffers_false_leaves_buffers_out_of_the_init_sync():
    seen = launch.ranks(_init_sync_buffers, 2)[0]
    assert seen["{'broadcast_buffers': False}"] == ([0.0, 1.0], [0.0, 11.0])  # never synced
    assert seen["{'broadcast_buffers': True}"] == ([0.0, 0.0], [0.0, 0.0])
    assert seen["{'forward_sync_buffers': False}"] == ([0.0, 0.0], [0.0, 10.0])  # init only
    assert seen["{}"] == ([0.0, 0.0], [0.0, 0.0])


# -------------------------------------------------------------------- 4. undefined gradients
class NoneGrad(torch.autograd.Function):
    """Its backward returns None: the gradients behind it are undefined."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x, cut):
        h = self.body(x)
        return self.head(NoneGrad.apply(h) if cut else h)


def _undefined(rank, world_size):
    """Every case on the same two ranks: (find_unused_parameters, ranks whose graph is cut)."""
    return {case: _undefined_case(rank, world_size, *case)
            for case in [(True, (0, 1)), (False, (0, 1)), (True, (0,)), (False, (0,))]}


def _undefined_case(rank, world_size, find_unused, cut_ranks):
    runs = []
    for cls in WRAPPERS:
        torch.manual_seed(0)
        model = cls(Gated(), find_unused_parameters=find_unused)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for step in range(3):
            x, y = batch(step, world_size)
            out = model(shard(x, rank), cut=rank in cut_ranks)
            nn.functional.mse_loss(out, shard(y, rank)).backward()
            grads.append(_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((grads, params_of(model)))
    for a, b in zip(runs[0][0], runs[1][0]):
        _assert_same_grads(a, b)
    assert_same_params(runs[0][1], runs[1][1])
    return runs[0][0][-1]["body.weight"]


def test_undefined_gradients_like_torch():
    for (find_unused, cut_ranks), grad in launch.ranks(_undefined, 2)[0].items():
        if cut_ranks == (0, 1):  # torch: None with find_unused_parameters, zeros without
            assert grad is None if find_unused else torch.equal(grad, torch.zeros(8, 8))
        else:
            assert grad is not None and grad.abs().sum() > 0  # rank 1's gradient, averaged


def _undefined_grad_op(rank, world_size):
    """torch's test_undefined_grad_parity_unused_parameters, on CPU."""
    x = torch.ones(1, 2)
    net = nn.Sequential(nn.Linear(2, 10, bias=False), nn.ReLU(), nn.Linear(10, 4))
    local = copy.deepcopy(net)
    for cls in WRAPPERS:
        ddp = cls(copy.deepcopy(net), find_unused_parameters=True)
        torch._C._functions.UndefinedGrad()(ddp(x).sum()).backward()
        torch._C._functions.UndefinedGrad()(local(x).sum()).backward()
        _assert_same_grads(_grads(ddp), _grads(local))


def test_undefined_grad_parity_unused_parameters():
    launch.ranks(_undefined_grad_op, 2)


# ------------------------------------------------------------------------------ 5. pickling
def _pickling(rank, world_size, grad_is_view):
    torch.manual_seed(0)
    base = MLP()
    finals = []
    for cls in WRAPPERS:
        ddp = cls(copy.deepcopy(base), bucket_cap_mb=0.001, gradient_as_bucket_view=grad_is_view)
        _sgd_steps(ddp, rank, world_size, range(2))
        buf = io.BytesIO()
        torch.save(ddp, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        twin = copy.deepcopy(ddp)  # an EMA or teacher copy
        for model in (ddp, loaded, twin):  # every copy trains (and reduces) like the original
            _sgd_steps(model, rank, world_size, range(2, 4))
        finals.append([params_of(m) for m in (ddp, loaded, twin)])
        assert type(loaded) is cls and loaded.module is not ddp.module
    for ours, theirs in zip(*finals):
        assert_same_params(ours, theirs)
    assert_same_params(finals[0][0], finals[0][1])
    assert_same_params(finals[0][0], finals[0][2])
    group = dist.new_group(list(range(world_size)))
    for cls in WRAPPERS:  # torch's rule: only a wrapper on the default group pickles
        with pytest.raises(RuntimeError, match="DDP Pickling/Unpickling are only supported"):
            copy.deepcopy(cls(MLP(), process_group=group))


@pytest.mark.parametrize("grad_is_view", [False, True])
def test_wrapper_pickles_and_the_copies_train_like_torchs(grad_is_view):
    launch.ranks(_pickling, 2, grad_is_view)


# ----------------------------------------------------------- 6. torch 2.13's constructor arguments
def test_constructor_takes_torchs_arguments_in_torchs_order():
    ours = list(inspect.signature(minddp.DDP.__init__).parameters.values())
    theirs = list(inspect.signature(TORCH_DDP.__init__).parameters)
    assert [p.name for p in ours[: len(theirs)]] == theirs
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs):])  # minddp's own


def _warnings(rank, world_size):
    cases = [{"broadcast_buffers": True}, {"broadcast_buffers": False}, {},
             {"broadcast_buffers": False, "forward_sync_buffers": True},
             {"broadcast_buffers": True, "forward_sync_buffers": False}, {"forward_sync_buffers": False},
             {"check_reduction": True}]
    for kwargs in cases:
        caught = []
        for cls in WRAPPERS:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                ddp = cls(nn.Linear(10, 10), **kwargs)  # one line for both: the same lineno
            caught.append([(w.category, str(w.message), w.filename, w.lineno) for w in record
                           if issubclass(w.category, FutureWarning)])
            assert ddp.forward_sync_buffers == ddp.broadcast_buffers == kwargs.get(
                "forward_sync_buffers", kwargs.get("broadcast_buffers", True))
        assert caught[0] == caught[1], kwargs
        assert bool(caught[0]) == any(k in kwargs for k in ("broadcast_buffers", "check_reduction"))


def test_broadcast_buffers_futurewarning_as_torch():
    launch.ranks(_warnings, 2)


@pytest.mark.parametrize("seed", range(20))
def test_bucket_cap_mb_list_assigns_like_torchs_reducer(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([10, 1000, 50_000, 200_000, 400_000]) for _ in range(rng.randint(1, 12))]
    dtypes = [rng.choice([torch.float32, torch.float64]) for _ in sizes]
    caps = [rng.choice([0.1, 0.5, 1, 2]) for _ in range(rng.randint(1, 3))]
    tensors = [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)]
    order = list(reversed(range(len(sizes))))
    # torch's reducer passes the tensors in ready order, their indices as labels
    limits = [int(c * MiB) for c in caps]
    ready = [tensors[i] for i in order]
    theirs, _ = dist._compute_bucket_assignment_by_size(ready, limits, [False] * len(sizes), order)
    ours = assign_buckets([TensorSpec.of(t) for t in tensors], order, None, caps_mb=caps)
    assert sorted(map(sorted, ours)) == sorted(map(sorted, theirs))


def _cap_list(rank, world_size):
    torch.manual_seed(0)
    base = MLP(width=128, depth=5)
    caps = [0.04, 0.07]
    models = [cls(copy.deepcopy(base), bucket_cap_mb_list=caps, batched_grad_copy=True) for cls in WRAPPERS]
    for model in models:
        _sgd_steps(model, rank, world_size, range(3))  # both rebuild their buckets after the first
    ours, theirs = models
    assert_same_params(params_of(ours), params_of(theirs))
    torch_sizes = [int(s) for s in theirs._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]
    return [b.grad_nbytes for b in ours.layout.buckets], torch_sizes


def test_bucket_cap_mb_list_gives_torchs_buckets_and_batched_grad_copy_is_accepted():
    ours, theirs = launch.ranks(_cap_list, 2)[0]
    assert ours == theirs and len(ours) > 2


class LargeNet(nn.Module):
    """torch's test_skip_all_reduce_unused_parameters model: fc2 is never used."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(100, 5000, bias=False)
        self.fc2 = nn.Linear(100, 100, bias=False)
        self.fc3 = nn.Linear(100, 100, bias=False)  # unused too: a bucket of its own before the last

    def forward(self, x):
        return self.fc1(x)


def _skip_unused(rank, world_size):
    return {skip: _skip_unused_case(rank, world_size, skip) for skip in (True, False)}


def _skip_unused_case(rank, world_size, skip):
    torch.manual_seed(31415)
    base = LargeNet()
    models = [cls(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=0.03,
                  skip_all_reduce_unused_params=skip) for cls in WRAPPERS]
    x = torch.randn(20, 100, generator=torch.Generator().manual_seed(rank))
    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert_same_params(params_of(models[0]), params_of(models[1]))
    assert models[0].module.fc2.weight.grad is None
    return models[0].comm_stats.bytes


def test_skip_all_reduce_unused_params_reduces_only_used_buckets():
    skipped, reduced = launch.ranks(_skip_unused, 2)[0].values()
    assert skipped == 100 * 5000 * 4  # fc1's gradients only
    assert reduced == (100 * 5000 + 2 * 100 * 100 + 3) * 4  # + the 3 usage flags, in the last bucket


# ----------------------------------------------------------------------------- 8. re-wrapping
def _rewrap(rank, world_size):
    torch.manual_seed(0)
    base = MLP()
    finals, olds = [], []
    for cls in WRAPPERS:
        model, wrappers = copy.deepcopy(base), []
        for cap in (0.001, None, 0.01):  # a sweep over options in one process; old ones stay referenced
            wrappers.append(cls(model, bucket_cap_mb=cap))
        _sgd_steps(wrappers[-1], rank, world_size, range(3))
        finals.append(params_of(wrappers[-1]))
        olds.append(wrappers[:-1])
    assert_same_params(finals[0], finals[1])
    _same_everywhere(finals[0])
    for old in olds[0]:  # minddp's earlier wrappers were retired, and say why
        with pytest.raises(RuntimeError, match="wrapped again by a newer DistributedDataParallel"):
            old(torch.zeros(1, 8))


def test_wrapping_a_wrapped_module_again_takes_it_over():
    launch.ranks(_rewrap, 2)


# ------------------------------------------------- 9. _set_params_and_buffers_to_ignore_for_model
def _ignored(rank, world_size):
    ignore = ["fc.weight", "bn.running_mean"]
    runs = []
    for cls in WRAPPERS:
        torch.manual_seed(rank)  # rank-local start: only what is synchronised becomes equal
        model = WithBN()
        cls._set_params_and_buffers_to_ignore_for_model(model, ignore)
        assert model._ddp_params_and_buffers_to_ignore == ignore and model.fc.weight._ddp_ignored
        ddp = cls(model)
        _sgd_steps(ddp, rank, world_size, range(3))
        ddp.eval()
        with torch.no_grad():  # its buffer broadcast is the last word (BatchNorm in eval keeps it)
            ddp(torch.zeros(2, 8))
        runs.append(dict(model.state_dict()))
    for n in runs[0]:
        assert_close(runs[0][n], runs[1][n], atol=1e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    ours = runs[0]
    return {n: all(torch.equal(t, ours[n]) for t in _everyone(ours[n])) for n in ours}


def test_ignored_parameters_and_buffers_are_neither_reduced_nor_broadcast():
    same = launch.ranks(_ignored, 2)[0]
    assert not same["fc.weight"] and not same["bn.running_mean"]
    assert same["fc.bias"] and same["out.weight"] and same["bn.running_var"]


# ------------------------------------------------------------ 10. torch's errors, at torch's time
def _errors(rank, world_size):
    texts = []
    for cls in WRAPPERS:
        with pytest.raises(RuntimeError) as no_grad:
            cls(MLP().requires_grad_(False))
        ddp = cls(MLP())
        with pytest.raises(TypeError) as not_callable:
            ddp.register_comm_hook(None, "allreduce")

        def typed(state, bucket: int):
            return None

        with pytest.raises(ValueError) as annotated:
            ddp.register_comm_hook(None, typed)
        texts.append([str(e.value) for e in (no_grad, not_callable, annotated)])
    assert texts[0] == texts[1]
    assert texts[0][:2] == ["DistributedDataParallel is not needed when a module doesn't have any parameter "
                            "that requires a gradient.", "Communication hook must be callable."]


def test_torchs_errors_for_no_trainable_parameter_and_a_bad_comm_hook():
    launch.ranks(_errors, 2)


# ------------------------------------------- 11. usage flags read once landed, never waited for early
class _InFlight:
    """The CUDA event of a device-to-host copy that lands after `after` queries (the CPU has no
    such event): counts the host waits (synchronize) the engine asks of it."""

    def __init__(self, after: int):
        self.after, self.queries, self.waits = after, 0, 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.after

    def synchronize(self) -> None:
        self.waits += 1


def _usage_with_copy_landing_after(monkeypatch, flags: list[float], after: int):
    usage = UsageFlags(["a", "b"], tolerate_unused=False)
    event = _InFlight(after)

    def to_host(tail):
        copy = transfer.HostCopy(tail)
        copy.event = event
        return copy

    monkeypatch.setattr(transfer, "to_host", to_host)
    usage.reduced(torch.tensor(flags), [True, True], [], None, None)
    return usage, event


def test_usage_flags_are_read_once_landed_without_a_host_wait(monkeypatch):
    usage, event = _usage_with_copy_landing_after(monkeypatch, [0.0, 1.0], after=1)
    usage.check()  # the next forward: still in flight, no wait, no verdict yet
    with pytest.raises(RuntimeError, match="'b'"):
        usage.check()  # landed: read, and raised
    assert event.waits == 0 and event.queries == 2


def test_usage_flags_still_in_flight_are_waited_for_after_max_defer_forwards(monkeypatch):
    usage, event = _usage_with_copy_landing_after(monkeypatch, [1.0, 0.0], after=10**9)
    for _ in range(MAX_DEFER):
        usage.check()
    assert event.waits == 0
    with pytest.raises(RuntimeError, match="'a'"):
        usage.check()  # bounded: this forward waits, so every rank names the parameter
    assert event.waits == 1


def test_usage_flags_of_later_backwards_queue_behind_the_first(monkeypatch):
    usage, event = _usage_with_copy_landing_after(monkeypatch, [0.0, 0.0], after=1)
    usage.check()
    usage.reduced(torch.tensor([0.0, 0.0]), [True, True], [], None, None)  # the next step's
    usage.check()
    usage.check()
    assert event.waits == 0 and not usage._pending
