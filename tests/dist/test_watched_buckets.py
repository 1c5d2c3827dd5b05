"""One hook per bucket once the buckets are rebuilt: every `.grad` is its bucket view when the
backward starts, autograd adds into it, and a bucket is complete when its buffer's version counter
moved once per parameter. Bitwise against torch DDP on 2 gloo ranks in the loops people write
(zero_grad before or after the forward, accumulation under no_sync), and the ways it can lose
track (a graph whose order changes, a parameter that stops being used): per-gradient hooks then
take over, and nothing is reduced early."""

import copy

import pytest
import torch
from torch import nn

import minddp
from tests import launch


class TwoBranches(nn.Module):
    """Two branches whose order in the forward (so in the backward) can flip per step."""

    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x, flip=False, use_b=True):
        h = torch.tanh(self.stem(x))
        if not use_b:
            return self.head(self.a(h))
        first, second = (self.b, self.a) if flip else (self.a, self.b)
        u = first(h)
        v = second(h)
        return self.head(u * v)


def _loop(model, rank, steps, loop, cap):
    """Per step: the gradients after the backward, then SGD. `loop`: how the script drives it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads, watching = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
        flip = loop == "reorder" and step >= 3 and step % 2 == 1
        if loop == "accumulate":  # nanoGPT's way: the sync flag on the last micro-step only
            for micro in range(3):
                model.require_backward_grad_sync = micro == 2
                nn.functional.mse_loss(model(x[2 * micro:2 * micro + 2]), y[2 * micro:2 * micro + 2]).backward()
        else:
            if loop != "tutorial":
                opt.zero_grad()
            loss = nn.functional.mse_loss(model(x, flip), y)
            if loop == "tutorial":  # forward, zero_grad, backward, step
                opt.zero_grad()
            loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if loop == "accumulate":
            opt.zero_grad()
        watching.append(model.reducer.watching if isinstance(model, minddp.DDP) else None)
    return grads, [p.detach().clone() for p in model.parameters()], watching


def _against_torch(rank, world, loop, cap):
    torch.manual_seed(0)
    base = TwoBranches()
    ours = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    mine, final, watching = _loop(ours, rank, 8, loop, cap)
    torchs, torch_final, _ = _loop(theirs, rank, 8, loop, cap)
    for step, (a, b) in enumerate(zip(mine, torchs)):
        for ga, gb in zip(a, b):
            assert torch.equal(ga, gb), (loop, step)
    assert all(torch.equal(p, q) for p, q in zip(final, torch_final))
    return watching, len(ours.bucket_assignment), ours.reducer.hooks.hooked


@pytest.mark.parametrize("loop", ["default", "tutorial", "accumulate"])
@pytest.mark.parametrize("cap", [25, 0.0004])
def test_one_hook_per_bucket_is_bitwise_torch_ddp(loop, cap):
    """From the second iteration on, one hook per bucket, and every gradient equals torch DDP's,
    step by step, with one bucket or several."""
    for watching, buckets, hooked in launch.ranks(_against_torch, 2, loop, cap, timeout=120):
        assert watching[0] is True and all(watching)  # watched from the rebuild at the first's end
        assert hooked == buckets and (cap == 25) == (buckets == 1)


def test_a_graph_whose_order_changes_goes_back_to_a_hook_per_gradient():
    """The branches swap places on odd steps from step 3 (small buckets, one holding both): the
    watched gradient comes before the rest of its bucket, so that bucket and the ones after it go
    out at the backward's end, and per-gradient hooks take over; every gradient is still torch
    DDP's. (With one bucket the order inside it does not matter: its watched gradient, the
    stem's, comes last either way.)"""
    for watching, buckets, hooked in launch.ranks(_against_torch, 2, "reorder", 0.0004, timeout=120):
        assert watching[:3] == [True] * 3 and watching[3:] == [False] * 5
        assert hooked == 8  # every parameter again


def _stops_using(rank, world):
    torch.manual_seed(0)
    model = minddp.DDP(TwoBranches())
    for step in range(6):
        x = torch.randn(2, 4)
        try:
            model(x, use_b=step < 3 or rank == 1).sum().backward()
        except RuntimeError as e:
            return step, str(e)
    return None, ""


def test_a_parameter_that_stops_being_used_is_named_on_every_rank():
    """From step 3, rank 0 leaves branch b unused (find_unused_parameters=False): its watched
    bucket is incomplete, hands over to per-gradient hooks, and the forward after the next
    backward raises on every rank, naming b's parameters (torch raises one step earlier,
    naming none)."""
    for step, message in launch.ranks(_stops_using, 2, timeout=120):
        assert step == 5 and "b.weight" in message and "b.bias" in message, (step, message)


def _grad_of_input(rank, world):
    model = minddp.DDP(TwoBranches())
    for _ in range(3):  # watched from the second
        model.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
    model.zero_grad()
    x = torch.randn(2, 4, requires_grad=True)
    (gx,) = torch.autograd.grad(model(x).sum(), x)  # FGSM: the input's gradient only
    return gx.shape, [p.grad for p in model.parameters()]


def test_a_backward_that_reaches_no_parameter_leaves_grad_none():
    """`.grad` is pointed at the buckets when the forward ends; a backward that reaches no
    parameter (autograd.grad of the input) puts None back, as torch leaves it."""
    for shape, grads in launch.ranks(_grad_of_input, 2, timeout=120):
        assert shape == (2, 4) and all(g is None for g in grads)
