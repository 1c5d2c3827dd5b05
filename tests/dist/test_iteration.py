"""The reducer's iteration against torch DDP's, on two gloo ranks: the same script runs with
torch's wrapper and with minddp's, and gradients, parameters, buffers and error types must agree.

- activation checkpointing of every shape torch's source-tree tests use (reentrant once, twice,
  weight sharing, the DDP model itself checkpointed; with and without static_graph and
  find_unused_parameters): the end-of-backward callback belongs to the outermost backward of the
  graph the forward built, not to a checkpoint's nested recomputation;
- two forwards with BatchNorm before one backward (the second forward's buffer broadcast must not
  mark a tensor the first saved for backward as modified);
- a backward outside a DDP forward's iteration (through the plain module, or a retained graph's
  second backward): the local gradient, no error;
- register_comm_hook twice: torch's RuntimeError.
"""

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import minddp
from tests import launch
from tests.models import WithBN

TORCH_DDP = nn.parallel.DistributedDataParallel
WRAPPERS = {"torch": TORCH_DDP, "minddp": minddp.DDP}


class CheckpointOnce(nn.Module):
    """torch's CheckpointOnceModule: l2 under checkpoint, l1 outside."""

    def __init__(self, use_reentrant=True):
        super().__init__()
        self.l1, self.l2 = nn.Linear(20, 20), nn.Linear(20, 20)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        return checkpoint(self.l2, self.l1(x), use_reentrant=self.use_reentrant)


class CheckpointTwice(CheckpointOnce):
    def forward(self, x):
        x = checkpoint(self.l2, self.l1(x), use_reentrant=self.use_reentrant)
        return checkpoint(self.l2, x, use_reentrant=self.use_reentrant)


class CheckpointTwiceWeightSharing(CheckpointTwice):
    def __init__(self, use_reentrant=True):
        super().__init__(use_reentrant)
        self.l1.weight = self.l2.weight


class AllInsideCheckpoints(CheckpointOnce):
    """Every parameter under a checkpoint: no hook fires in the outer backward at all."""

    def forward(self, x):
        x = checkpoint(self.l1, x, use_reentrant=self.use_reentrant)
        return checkpoint(self.l2, x, use_reentrant=self.use_reentrant)


def _as_torch(per_rank: list[dict]) -> list[dict]:
    """Every rank's tensors under minddp equal, bitwise, its tensors under torch DDP."""
    for got in per_rank:
        assert len(got["torch"]) == len(got["minddp"])
        for x, y in zip(got["torch"], got["minddp"]):
            assert torch.equal(x, y)
    return per_rank


def _shared_sequential():
    l1, l2 = nn.Linear(20, 20), nn.Linear(20, 20)
    l1.weight = l2.weight
    return nn.Sequential(l1, l2)


MODELS = {"once": CheckpointOnce, "twice": CheckpointTwice,
          "twice_weight_sharing": CheckpointTwiceWeightSharing,
          "all_inside": AllInsideCheckpoints, "shared_sequential": lambda use_reentrant: _shared_sequential()}


def _train(rank, world_size, wrapper, name, use_reentrant, static_graph, find_unused, whole_model):
    """torch's _test_ddp_checkpointing: 5 iterations, each rank its shard; grads and params."""
    torch.manual_seed(31415)
    model = WRAPPERS[wrapper](MODELS[name](use_reentrant=use_reentrant), bucket_cap_mb=1,
                              static_graph=static_graph, find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x = torch.rand(16 * world_size, 20, generator=g)[rank * 16:(rank + 1) * 16].requires_grad_()
        y = torch.randn(16 * world_size, 20, generator=g)[rank * 16:(rank + 1) * 16]
        opt.zero_grad(set_to_none=False)
        out = checkpoint(model, x, use_reentrant=use_reentrant) if whole_model else model(x)
        nn.functional.mse_loss(out, y).backward()
        seen.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return seen, [p.detach().clone() for p in model.parameters()]


def _both(name, use_reentrant, static_graph, find_unused=False, whole_model=False):
    def run(rank, world_size):
        return {w: _train(rank, world_size, w, name, use_reentrant, static_graph, find_unused, whole_model)
                for w in WRAPPERS}
    return run


CHECKPOINT_SHAPES = [  # (model, use_reentrant, static_graph, find_unused_parameters, DDP model checkpointed)
    ("once", True, False, False, False),
    ("once", True, True, False, False),
    ("once", True, True, True, False),  # torch ignores find_unused under static_graph
    ("once", False, True, False, False),
    ("once", False, False, True, False),
    ("twice", True, True, False, False),
    ("twice", False, False, False, False),
    ("twice_weight_sharing", True, True, False, False),
    ("all_inside", True, False, False, False),
    ("all_inside", True, True, False, False),
    ("shared_sequential", True, False, False, True),
    ("shared_sequential", True, True, False, True),
    ("shared_sequential", False, False, False, True),  # non-reentrant: the recomputation calls DDP's forward
    ("shared_sequential", False, True, False, True),
    ("once", False, False, False, True),
]


@pytest.mark.parametrize("shape", CHECKPOINT_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_activation_checkpointing_trains_as_torch_ddp(shape):
    for per_rank in launch.ranks(_both(*shape), 2, timeout=120):
        (ref_grads, ref_params), (grads, params) = per_rank["torch"], per_rank["minddp"]
        for step, (a, b) in enumerate(zip(ref_grads, grads)):
            for k, (x, y) in enumerate(zip(a, b)):
                torch.testing.assert_close(y, x, rtol=1.3e-6, atol=5e-5, msg=f"step {step} grad {k}")
        for x, y in zip(ref_params, params):
            torch.testing.assert_close(y, x, rtol=1.3e-6, atol=5e-5)


def _errors(name, use_reentrant, static_graph, find_unused):
    def run(rank, world_size):
        texts = {}
        for w in WRAPPERS:
            try:
                _train(rank, world_size, w, name, use_reentrant, static_graph, find_unused, False)
                texts[w] = None
            except RuntimeError as e:
                texts[w] = str(e)
        return texts
    return run


@pytest.mark.parametrize("find_unused", [False, True])
def test_reentrant_checkpoint_twice_without_static_graph_raises_torchs_error(find_unused):
    for texts in launch.ranks(_errors("twice", True, False, find_unused), 2, timeout=120):
        assert "Expected to mark a variable ready only once" in texts["torch"]
        assert "Expected to mark a variable ready only once" in texts["minddp"]


# ------------------------------------------------ two forwards, one backward (BatchNorm)
def _two_forwards(rank, world_size):
    out = {}
    for w, cls in WRAPPERS.items():
        torch.manual_seed(0)
        model = cls(WithBN())
        g = torch.Generator().manual_seed(rank)
        x1, x2 = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
        (model(x1).sum() + model(x2).pow(2).sum()).backward()
        out[w] = ([p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()])
    return out


def test_two_forwards_then_one_backward_with_batchnorm_as_torch_ddp():
    for per_rank in launch.ranks(_two_forwards, 2):
        for ref, got in zip(per_rank["torch"], per_rank["minddp"]):
            for x, y in zip(ref, got):
                assert torch.equal(x, y)


# ------------------------------------------------ a backward outside an iteration
def _outside(rank, world_size):
    out = {}
    for w, cls in WRAPPERS.items():
        torch.manual_seed(0)
        model = cls(nn.Linear(4, 3))
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
        loss = model(x).sum()
        loss.backward(retain_graph=True)
        reduced = [p.grad.clone() for p in model.parameters()]
        loss.backward()  # torch: the retained graph's second backward adds the local gradient
        again = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model.module(x).pow(2).sum().backward()  # the plain module (test_save_load_checkpoint)
        plain = [p.grad.clone() for p in model.parameters()]
        nn.functional.mse_loss(model(x), torch.zeros(5, 3)).backward()  # and the wrapper again
        out[w] = reduced + again + plain + [p.grad.clone() for p in model.parameters()]
    return out


def test_backward_outside_a_ddp_forward_leaves_the_local_gradient_as_torch():
    per_rank = _as_torch(launch.ranks(_outside, 2))
    assert not torch.equal(per_rank[0]["minddp"][4], per_rank[1]["minddp"][4])  # local: differs


# ------------------------------------------------ register_comm_hook once
def _hook_twice(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    texts = {}
    for w, cls in WRAPPERS.items():
        model = cls(nn.Linear(4, 3))
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        try:
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        except RuntimeError as e:
            texts[w] = str(e)
    return texts


def test_register_comm_hook_twice_raises_torchs_error():
    for texts in launch.ranks(_hook_twice, 2):
        assert texts["minddp"] == texts["torch"], texts



# ------------------------------------------------ backwards that mark no gradient, other outputs
def _input_gradient_then_loss(rank, world_size, find_unused):
    """FGSM / a gradient penalty: autograd.grad w.r.t. the input goes through the output's node but
    accumulates no parameter gradient; the iteration ends with the backward that does."""
    out = {}
    for w, cls in WRAPPERS.items():
        torch.manual_seed(0)
        model = cls(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)),
                    find_unused_parameters=find_unused)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * rank + step)).requires_grad_()
            (g,) = torch.autograd.grad(model(x).sum(), x)  # its own forward, then no parameter hook
            penalty = model(x + 0.1 * g.sign()).pow(2).mean()
            opt.zero_grad()
            penalty.backward()
            opt.step()
        out[w] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("find_unused", [False, True])
def test_a_backward_to_the_input_only_leaves_the_iteration_to_the_real_backward(find_unused):
    _as_torch(launch.ranks(_input_gradient_then_loss, 2, find_unused))


class LossInside(nn.Module):
    """The loss is kept on the module; the wrapper's output has a graph the loss's backward never
    reaches (its own node), so only the gradients' hooks can end the iteration."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x):
        h = self.l1(x)
        self.loss = self.l2(torch.relu(h)).pow(2).mean()
        return h * 2


def _loss_off_the_output(rank, world_size, overlap):
    out = {}
    for w, cls in WRAPPERS.items():
        torch.manual_seed(0)
        kwargs = {} if w == "torch" else {"overlap": overlap}
        model = cls(LossInside(), **kwargs)
        for step in range(2):
            model.zero_grad()
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + step)))
            model.module.loss.backward()
            out.setdefault(w, []).append([p.grad.clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("overlap", [True, False])
def test_a_loss_that_bypasses_the_output_is_reduced_with_and_without_overlap(overlap):
    for per_rank in launch.ranks(_loss_off_the_output, 2, overlap):
        for a, b in zip(per_rank["torch"], per_rank["minddp"]):
            for x, y in zip(a, b):
                torch.testing.assert_close(y, x)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


class CheckpointedToDataclass(AllInsideCheckpoints):
    def forward(self, x):
        return Output(super().forward(x))


def _dataclass_output(rank, world_size):
    out = {}
    for w, cls in WRAPPERS.items():
        torch.manual_seed(0)
        model = cls(CheckpointedToDataclass(use_reentrant=True))
        x = torch.randn(8, 20, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        model(x).logits.pow(2).sum().backward()
        out[w] = [p.grad.clone() for p in model.parameters()]
    return out


def test_a_dataclass_output_ends_the_iteration_after_reentrant_checkpoints():
    for per_rank in launch.ranks(_dataclass_output, 2):
        for x, y in zip(per_rank["torch"], per_rank["minddp"]):
            torch.testing.assert_close(y, x)


def _forward_raises_then_no_sync(rank, world_size):
    """A forward that raised (a caught bad batch) starts no iteration: the next no_sync()
    micro-step keeps its gradient local, as torch's (prepare_for_backward after the forward)."""
    out = {}
    for w, cls in WRAPPERS.items():
        torch.manual_seed(0)
        model = cls(nn.Linear(4, 3))
        try:
            model(torch.randn(2, 5))  # wrong width: the module raises
        except RuntimeError:
            pass
        with model.no_sync():
            model(torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
        out[w] = [p.grad.clone() for p in model.parameters()]
    return out


def test_a_forward_that_raised_starts_no_iteration():
    per_rank = _as_torch(launch.ranks(_forward_raises_then_no_sync, 2))
    assert not torch.equal(per_rank[0]["minddp"][0], per_rank[1]["minddp"][0])  # local: differs


class _Stop(Exception):
    pass


def _backward_interrupted(rank, world_size):
    """A backward that raised half-way (a caught error in a tensor hook) leaves an iteration whose
    first gradients were copied into their bucket with the average's 1/n fused in. After torch's
    "finished reduction" error at the next forward, the iteration after it must average every
    gradient once: accumulated in place here (zero_grad(set_to_none=False)). Every rank gets the
    same batch, so the average is the local gradient (a sum would be twice it)."""
    torch.manual_seed(0)
    model = minddp.DDP(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)))
    plain = copy.deepcopy(model.module)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    def stop(grad):
        raise _Stop

    hidden = model.module[1].register_forward_hook(lambda m, i, out: (out.register_hook(stop), None)[1])
    try:
        model(x).sum().backward()  # the last layer's gradients are in the bucket, then the hook raises
    except _Stop:
        pass
    hidden.remove()
    model.zero_grad(set_to_none=False)
    errors = []
    try:
        model(x)
    except RuntimeError as e:
        errors.append("finished reduction" in str(e))
    model.zero_grad(set_to_none=False)
    model(x).sum().backward()
    plain(x).sum().backward()
    pairs = zip(model.parameters(), plain.parameters())
    return errors, [(a.grad - b.grad).abs().max().item() for a, b in pairs]


def test_an_iteration_abandoned_half_way_leaves_nothing_to_the_next():
    for errors, diffs in launch.ranks(_backward_interrupted, 2):
        assert errors == [True]
        assert max(diffs) < 1e-6, diffs
