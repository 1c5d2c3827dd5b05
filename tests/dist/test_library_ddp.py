"""minddp inside the libraries that build torch's DDP themselves, each configuration run twice on the
same 2 gloo ranks: once with torch DDP, once with minddp (`minddp.as_torch_ddp()` around the Hugging
Face Trainer, which builds DDP through accelerate; minddp's Lightning strategies). Every rank's losses,
reduced gradients, final weights and buffers (BatchNorm's running statistics) are bitwise torch's."""

import contextlib
import importlib
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import minddp
from minddp import _compat
from tests import hf_models
from tests.launch import ranks

# real Trainers on forked ranks, two runs a case (~60 s together on 2 cores): make test runs them
pytestmark = pytest.mark.slow

TIMEOUT_S = 120


def need(*packages, preload=()) -> None:
    """Skip where a package is absent (the dev extra brings them); import `preload` here, once, so
    that the forked ranks inherit it (transformers' Trainer takes ~3 s to import)."""
    for name in packages:
        pytest.importorskip(name, reason=f"{name} is not installed: pip install -e '.[dev]' brings it")
    for name in preload:
        importlib.import_module(name)


def assert_bitwise(torch_run: dict, minddp_run: dict, rank: int) -> None:
    """Each recorded tensor of minddp's run is torch's, bit for bit (names the first that is not)."""
    assert torch_run.keys() == minddp_run.keys()
    for key, theirs in torch_run.items():
        if key == "wrapper":
            continue
        ours = minddp_run[key]
        assert len(ours) == len(theirs), f"rank {rank}: {key}: {len(ours)} records, torch DDP {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            for name in b:
                assert torch.equal(a[name], b[name]), \
                    f"rank {rank}: {key}[{i}] {name}: minddp differs from torch DDP by " \
                    f"{(a[name].double() - b[name].double()).abs().max().item():.3g}"


def check(results: list) -> None:
    """results[rank] = {"torch": run, "minddp": run}; gradients are also equal across ranks."""
    for rank, runs in enumerate(results):
        assert runs["torch"]["wrapper"] == [{"class": "torch"}], runs["torch"]["wrapper"]
        assert runs["minddp"]["wrapper"] == [{"class": "minddp"}], runs["minddp"]["wrapper"]
        assert runs["torch"]["grads"], "no gradient recorded"
        assert_bitwise(runs["torch"], runs["minddp"], rank)
    for kind in ("torch", "minddp"):
        assert_bitwise({"grads": results[0][kind]["grads"]}, {"grads": results[1][kind]["grads"]}, 1)


def wrapper_class(model) -> dict:
    kinds = {_compat.TORCH_DDP: "torch", minddp.DistributedDataParallel: "minddp"}
    return {"class": kinds.get(type(model), str(type(model)))}


def tensors(named) -> dict:
    return {name: t.detach().clone() for name, t in named}


def grads(module) -> dict:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------ the switch itself
def _torch_ddp_inside_the_block(rank, world_size):
    """A torch DDP keeps working inside the block: only the public name changes, not the name in
    torch's own module, which its forward reads (swapped too, its forward raised AttributeError)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    results = []
    for inside in (False, True):
        model = _compat.TORCH_DDP(_net(unused=False))
        with minddp.as_torch_ddp() if inside else contextlib.nullcontext():
            model(x).sum().backward()
            results.append(grads(model.module))
    return results


def test_a_torch_ddp_works_inside_the_block():
    for outside, inside in ranks(_torch_ddp_inside_the_block, 2, timeout=TIMEOUT_S):
        assert outside.keys() == inside.keys() and all(torch.equal(outside[n], inside[n]) for n in outside)


# ------------------------------------------------------------------ HF Trainer + accelerate
class Tokens(Dataset):
    def __init__(self, n=32, length=16):
        self.ids = hf_models.ids(n, length)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


HF = {  # name: TrainingArguments beyond the common ones
    "accumulation": {"gradient_accumulation_steps": 2, "ddp_find_unused_parameters": False},
    "find_unused": {"gradient_accumulation_steps": 2, "ddp_find_unused_parameters": True},
    "checkpointing": {"gradient_accumulation_steps": 2, "ddp_find_unused_parameters": True,
                      "gradient_checkpointing": True,
                      "gradient_checkpointing_kwargs": {"use_reentrant": False}},
    "checkpointing_reentrant": {"gradient_accumulation_steps": 2, "ddp_find_unused_parameters": False,
                                "gradient_checkpointing": True,
                                "gradient_checkpointing_kwargs": {"use_reentrant": True}},
    # torch DDP's static graph under the Trainer's no_sync accumulation raises (pytorch#143580): one
    # micro-step a step, with the reentrant checkpoints static_graph exists for
    "static_graph": {"ddp_static_graph": True, "ddp_find_unused_parameters": False,
                     "gradient_checkpointing": True,
                     "gradient_checkpointing_kwargs": {"use_reentrant": True}},
}


def _hf_train(folder: str, options: dict) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    record = {"losses": [], "grads": [], "wrapper": []}

    class Recording(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            record["losses"].append({"loss": loss.detach().clone()})
            return loss

    class Reduced(TrainerCallback):  # the reduced gradients, before each optimizer step
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            record["grads"].append(grads(model))

    model = hf_models.gpt2(seed=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1).train()
    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=2, max_steps=3,
                             learning_rate=1e-2, use_cpu=True, ddp_backend="gloo", report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
                             dataloader_num_workers=0, **options)
    trainer = Recording(model=model, args=args, train_dataset=Tokens(), callbacks=[Reduced()])
    trainer.train()
    record["wrapper"].append(wrapper_class(trainer.model_wrapped))
    record["final"] = [tensors(model.state_dict().items())]
    return record


def _hf_both(rank, world_size, folder, options):
    theirs = _hf_train(f"{folder}/torch", options)
    with minddp.as_torch_ddp():
        ours = _hf_train(f"{folder}/minddp", options)
    return {"torch": theirs, "minddp": ours}


@pytest.mark.parametrize("name", list(HF))
def test_hf_trainer_under_as_torch_ddp_is_bitwise_torch_ddp(tmp_path, name):
    need("transformers", "accelerate", preload=["transformers.trainer"])
    check(ranks(_hf_both, 2, str(tmp_path), HF[name], timeout=TIMEOUT_S))


def _accelerate_train() -> dict:
    """accelerate's own loop, as its `trigger_sync_in_backward` docstring writes it: two forwards under
    `no_sync`, the second backward synchronised (it calls `model.reducer.prepare_for_backward([])`)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net = _net(unused=False)
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    x, y = _data().tensors
    x, y = x[accelerator.process_index::2], y[accelerator.process_index::2]
    record = {"losses": [], "grads": [], "buffers": [], "wrapper": [wrapper_class(model)]}
    for step in range(3):
        i = step * 8
        with accelerator.no_sync(model):
            loss_a = F.cross_entropy(model(x[i:i + 4]), y[i:i + 4])
            loss_b = F.cross_entropy(model(x[i + 4:i + 8]), y[i + 4:i + 8])
        accelerator.backward(loss_a)
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)
        record["losses"].append({"a": loss_a.detach().clone(), "b": loss_b.detach().clone()})
        record["buffers"].append(tensors(net.named_buffers()))
        record["grads"].append(grads(net))
        opt.step()
        opt.zero_grad()
    record["final"] = [_state(net)]
    return record


def _accelerate_both(rank, world_size):
    theirs = _accelerate_train()
    with minddp.as_torch_ddp():
        ours = _accelerate_train()
    return {"torch": theirs, "minddp": ours}


def test_accelerates_trigger_sync_in_backward_under_as_torch_ddp_is_bitwise_torch_ddp():
    need("accelerate", preload=["accelerate"])
    check(ranks(_accelerate_both, 2, timeout=TIMEOUT_S))


# ------------------------------------------------------------------------- Lightning
def _net(unused: bool) -> nn.Module:
    """A small MLP with BatchNorm (running statistics differ by rank, so the buffer broadcast shows),
    and with `unused`, a layer no forward uses (torch DDP then needs find_unused_parameters)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    if unused:
        net.add_module("unused", nn.Linear(4, 4))
        net.forward = lambda x: nn.Sequential.forward(net[:4], x)
    return net


def _data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def _state(module) -> dict:
    return tensors([*module.named_parameters(), *module.named_buffers()])


def _isolated(run, *args):
    """Lightning's cluster environment removes WORLD_SIZE at teardown: each run gets the rank's own."""
    env = dict(os.environ)
    try:
        return run(*args)
    finally:
        os.environ.clear()
        os.environ.update(env)


FABRIC = {  # name: (strategy keyword arguments, micro-steps a step)
    "plain": ({}, 1),
    "no_backward_sync": ({}, 2),
    "find_unused": ({"find_unused_parameters": True}, 1),
}


def _fabric_train(strategy, micro_steps: int, unused: bool) -> dict:
    from lightning import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()  # the processes exist (torchrun's environment): Fabric joins their process group
    net = _net(unused)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    x, y = _data().tensors
    x, y = x[fabric.global_rank::2], y[fabric.global_rank::2]
    record = {"losses": [], "grads": [], "buffers": [], "wrapper": [wrapper_class(model._forward_module)]}
    for step in range(3):
        for m in range(micro_steps):
            i = (step * micro_steps + m) * 4
            with fabric.no_backward_sync(model, enabled=m < micro_steps - 1):
                loss = F.cross_entropy(model(x[i:i + 4]), y[i:i + 4]) / micro_steps
                fabric.backward(loss)
            record["losses"].append({"loss": loss.detach().clone()})
            record["buffers"].append(tensors(net.named_buffers()))
        record["grads"].append(grads(net))
        opt.step()
        opt.zero_grad()
    record["final"] = [_state(net)]
    return record


def _fabric_both(rank, world_size, name):
    from lightning.fabric.strategies import DDPStrategy

    from minddp.integrations.lightning import MinddpFabricStrategy

    kwargs, micro_steps = FABRIC[name]
    unused = "find_unused_parameters" in kwargs
    return {"torch": _isolated(_fabric_train, DDPStrategy(**kwargs), micro_steps, unused),
            "minddp": _isolated(_fabric_train, MinddpFabricStrategy(**kwargs), micro_steps, unused)}


@pytest.mark.parametrize("name", list(FABRIC))
def test_lightning_fabric_with_minddps_strategy_is_bitwise_torch_ddp(name):
    need("lightning", preload=["minddp.integrations.lightning"])
    check(ranks(_fabric_both, 2, name, timeout=TIMEOUT_S))


TRAINER = {  # name: (strategy keyword arguments, Trainer arguments, manual optimization)
    "accumulation": ({}, {"accumulate_grad_batches": 2}, False),
    "find_unused": ({"find_unused_parameters": True}, {}, False),
    "manual_optimization": ({}, {}, True),
    "manual_optimization_static_graph": ({"static_graph": True}, {}, True),
}


def _lightning_module(unused: bool, manual: bool):
    import lightning

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net(unused)
            self.automatic_optimization = not manual
            self.record = {"losses": [], "grads": [], "buffers": [], "wrapper": []}

        def training_step(self, batch, i):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.record["losses"].append({"loss": loss.detach().clone()})
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                self.record["grads"].append(grads(self.net))
                opt.step()
                return None
            return loss

        def on_before_optimizer_step(self, optimizer):  # automatic: the reduced gradients
            self.record["grads"].append(grads(self.net))

        def on_train_start(self):
            self.record["wrapper"] = [wrapper_class(self.trainer.strategy.model)]

        def on_train_batch_end(self, *args):
            self.record["buffers"].append(tensors(self.net.named_buffers()))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return Module()


def _trainer_train(strategy, trainer_args: dict, unused: bool, manual: bool) -> dict:
    import lightning

    module = _lightning_module(unused, manual)
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, **trainer_args)
    trainer.fit(module, DataLoader(_data(), batch_size=4))
    return {**module.record, "final": [_state(module.net)]}


def _trainer_both(rank, world_size, name):
    from lightning.pytorch.strategies import DDPStrategy

    from minddp.integrations.lightning import MinddpStrategy

    kwargs, trainer_args, manual = TRAINER[name]
    unused = "find_unused_parameters" in kwargs
    return {"torch": _isolated(_trainer_train, DDPStrategy(**kwargs), trainer_args, unused, manual),
            "minddp": _isolated(_trainer_train, MinddpStrategy(**kwargs), trainer_args, unused, manual)}


# Lightning's manual optimization calls torch's reducer entries from outside the forward
# (model.reducer._rebuild_buckets(), .prepare_for_backward(outputs), ._delay_all_reduce()), and the
# buffer broadcast must be decided after the module's forward, as torch's _post_forward does
@pytest.mark.parametrize("name", list(TRAINER))
def test_lightning_trainer_with_minddps_strategy_is_bitwise_torch_ddp(name):
    need("lightning", preload=["minddp.integrations.lightning"])
    check(ranks(_trainer_both, 2, name, timeout=TIMEOUT_S))
