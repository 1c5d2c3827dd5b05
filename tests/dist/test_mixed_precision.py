"""torch DDP's `mixed_precision` (`_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`) on
minddp's wrapper, 2 gloo ranks. torch's own DDP does not run it on the CPU (its forward records a
stream event: "cpu backend doesn't support events"), so the reference is its definition, written
out here step by step on a plain module: the forward with every parameter and floating input cast
to param_dtype and the buffers held in buffer_dtype; each rank's gradient (in param_dtype) cast to
reduce_dtype, summed over ranks, divided by the world size in reduce_dtype; the parameters back in
full precision with `.grad` that reduced value in it; the optimizer steps them. Bitwise, over steps
with BatchNorm buffers, a frozen parameter and no_sync() accumulation (in param_dtype, as torch's)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

import minddp
from tests import launch
from tests.models import batch, shard

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CONFIGS = {
    "bf16, reduce fp32": _MixedPrecision(param_dtype=BF16, reduce_dtype=FP32, buffer_dtype=BF16),
    "bf16, reduce in bf16": _MixedPrecision(param_dtype=BF16, buffer_dtype=BF16),
    "bf16, reduce fp16": _MixedPrecision(param_dtype=BF16, reduce_dtype=FP16, buffer_dtype=BF16),
    "reduce only": _MixedPrecision(reduce_dtype=FP16),
}


class Net(nn.Module):
    """Linear, BatchNorm (buffers), a frozen scale, Linear: what the forward sees is recorded."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.scale = nn.Parameter(torch.full((16,), 0.5), requires_grad=False)
        self.out = nn.Linear(16, 4)
        self.seen: list = []

    def forward(self, x):
        self.seen.append((x.dtype, self.fc.weight.dtype, self.scale.dtype, self.bn.running_mean.dtype))
        return self.out(torch.relu(self.bn(self.fc(x))) * self.scale)


def _cast(t, dtype):
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def _reference_step(model, opt, mp, xs, ys, world_size):
    """One step of the definition on a plain module: micro-batches (x, y), the last synchronised."""
    full = [p.data for p in model.parameters()]
    for p in model.parameters():
        p.data = _cast(p.data, mp.param_dtype)
    for micro, (x, y) in enumerate(zip(xs, ys)):
        if micro == 0:  # the buffer sync, from rank 0, at a forward after a synchronised one (torch's)
            for b in model.buffers():
                dist.broadcast(b.data, src=0)
        out = model(_cast(x, mp.param_dtype))
        nn.functional.mse_loss(out.float(), y).backward()
    reduce = mp.reduce_dtype or mp.param_dtype or FP32
    for p, data in zip(model.parameters(), full):
        p.data = data
        if p.grad is None:
            continue
        every = [torch.empty_like(p.grad) for _ in range(world_size)]
        dist.all_gather(every, p.grad)
        total = every[0].to(reduce)
        for g in every[1:]:
            total = total + g.to(reduce)
        p.grad = total.div_(world_size).to(p.dtype)
    opt.step()
    opt.zero_grad()


def _train(rank, world_size, name, accum):
    mp = CONFIGS[name]
    torch.manual_seed(0)
    base = Net()
    ref = copy.deepcopy(base)
    for b in ref.buffers():
        if b.is_floating_point() and mp.buffer_dtype is not None:
            b.data = b.to(mp.buffer_dtype)
    ours = minddp.DDP(copy.deepcopy(base), mixed_precision=mp, bucket_cap_mb=1e-3)
    opt, ref_opt = torch.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    grads_after, dtypes_after = [], []
    for step in range(4):
        xs, ys = [], []
        for micro in range(accum):
            x, y = batch(step * accum + micro, world_size)
            xs.append(shard(x, rank))
            ys.append(shard(y, rank))
        _reference_step(ref, ref_opt, mp, xs, ys, world_size)
        for micro, (x, y) in enumerate(zip(xs, ys)):
            ours.require_backward_grad_sync = micro == accum - 1  # nanoGPT's way of no_sync()
            nn.functional.mse_loss(ours(x).float(), y).backward()
        dtypes_after.append(sorted({(str(p.dtype), str(p.grad.dtype)) for p in ours.parameters()
                                    if p.grad is not None} | {(str(p.dtype), "-") for p in ours.parameters()
                                                              if p.grad is None}))
        grads_after.append({n: p.grad.clone() for n, p in ours.module.named_parameters()
                            if p.grad is not None})
        opt.step()
        opt.zero_grad()
    state = {n: t.clone() for n, t in ours.module.state_dict().items()}
    ours.eval()
    with torch.no_grad():  # an evaluation forward leaves the parameters in full precision
        evaluated = ours(xs[0]).dtype
    return dict(ref={n: t.clone() for n, t in ref.state_dict().items()}, ours=state,
                seen=ours.module.seen[:2], ref_seen=ref.seen[:2], dtypes=dtypes_after, evaluated=evaluated,
                after_eval={str(p.dtype) for p in ours.parameters()}, grads=grads_after)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("name", CONFIGS)
def test_mixed_precision_trains_as_its_definition(name, accum):
    mp = CONFIGS[name]
    results = launch.ranks(_train, 2, name, accum, timeout=120)
    for r in results:
        assert r["seen"] == r["ref_seen"]  # what the forward saw: inputs, parameters, frozen, buffers
        expect = mp.param_dtype or FP32
        assert r["seen"][0][:3] == (expect, expect, expect)
        assert r["seen"][0][3] == (mp.buffer_dtype or FP32)
        assert {p for d in r["dtypes"] for p, _ in d} == {"torch.float32"}  # parameters full precision
        assert {g for d in r["dtypes"] for _, g in d} <= {"torch.float32", "-"}  # .grad full precision
        assert r["evaluated"] == expect and r["after_eval"] == {"torch.float32"}
        for k in r["ref"]:
            assert r["ours"][k].dtype == r["ref"][k].dtype, k
            assert torch.equal(r["ours"][k], r["ref"][k]), (k, (r["ours"][k] - r["ref"][k]).abs().max())
    for a, b in zip(results[0]["grads"], results[1]["grads"]):  # .grad: the same average on every rank
        assert all(torch.equal(a[n], b[n]) for n in a)


def _refusals(rank, world_size):
    mp = CONFIGS["bf16, reduce fp32"]
    errors = []
    for kwargs in (dict(compress="bf16"), dict(shard_optimizer=True), dict(optimizer_overlap=True),
                   dict(find_unused_parameters=True, skip_all_reduce_unused_params=True)):
        try:
            minddp.DDP(Net(), mixed_precision=mp, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    try:
        minddp.DDP(Net(), mixed_precision=_MixedPrecision(param_dtype=torch.int8))
    except ValueError as e:
        errors.append(str(e))
    model = minddp.DDP(Net(), mixed_precision=mp)
    try:
        model.register_comm_hook(None, lambda state, bucket: bucket.all_reduce(bucket.buffer()))
    except RuntimeError as e:
        errors.append(str(e))
    return errors


def test_what_mixed_precision_does_not_combine_with_is_refused_by_name():
    for errors in launch.ranks(_refusals, 2):
        assert len(errors) == 6, errors
        for e, name in zip(errors, ("compress", "shard_optimizer", "optimizer_overlap",
                                    "skip_all_reduce_unused_params", "param_dtype", "register_comm_hook")):
            assert name in e and "mixed_precision" in e, e
