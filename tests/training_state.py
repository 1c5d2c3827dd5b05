"""A tiny model trained by the trainer's own pieces (optimizer, schedule, batches) without a
Trainer, and what a rank ended with: shared by the tests of saving and loading the training
state (tests/dist/test_train_helpers.py, tests/e2e/test_dcp_checkpoints.py, ...)."""

from types import SimpleNamespace

import torch

from minddp.engine.ddp import DistributedDataParallel
from minddp.train.build import build_optimizer
from minddp.train.checkpoint import FILE, FOLDER
from minddp.train.checkpoint.state import RunState
from minddp.train.trainer import lr_factor

CPU = torch.device("cpu")


def setup(seed, device=CPU, shard=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    ddp = DistributedDataParallel(model, shard_optimizer=shard, bucket_cap_mb=0.0005)
    o = SimpleNamespace(lr=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.1, warmup_steps=2, min_lr=1e-3)
    opt = build_optimizer(model, o, device, ddp)
    factor = lambda step: lr_factor(step, o, 20)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optim, factor)
    return model, ddp, opt, sched, factor


def train(model, ddp, opt, sched, batches, steps):
    for step in steps:
        for x, y in batches.get(step - 1):
            torch.nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    opt.wait_params()  # ZeRO-1's all-gather of the updated parameters


def outcome(fn):
    """('ok', value) or (the exception's class name, its message): what a rank ended with."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the test compares every rank's
        return type(e).__name__, str(e)


def save_state(run_dir, step, *, model, opt, sched, batches, mesh, device=CPU, saved_with=None, folder=False,
               background=False, **_):
    """What CheckpointManager.save writes for a run (its RunState's state dict and identity), without
    a manager: a file, a folder, or a folder's BackgroundSave (to commit)."""
    pieces = RunState(model, opt, sched, batches, mesh, device)
    everything = {**pieces.state_dict(step, folder), **(saved_with or {})}
    if background:
        return FOLDER.save_in_background(run_dir, step, everything)
    return (FOLDER if folder else FILE).save(run_dir, step, everything)

