"""What a checkpoint holds of a training run, and how it comes back: model, optimizer, schedule,
data position and RNG, written at any dp/tp layout (sharded or not) and loadable at any other."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ...parallel import tensor_parallel as tp
from ..checkpoint import files as checkpoint
from ..metrics import flight_recorder
from ..safety.together import together


def save(run_dir, step: int, *, model, opt, sched, batches, mesh, device, saved_with: dict,
         log=None) -> None:
    """Collectives first, on every rank (full tensors gathered over tp, RNG states), then rank 0
    writes atomically; a failed write raises on every rank (none waits for rank 0). Positions
    are global (samples seen), so any dp can resume. `saved_with`: the run's config and data."""
    flight_recorder.set_context(phase="checkpoint")
    opt.wait_params()
    model_state = tp.full_state_dict(model, mesh.tp_group, mesh.tp_size)
    opt_state = tp.full_optimizer_state(opt, model, mesh.tp_group, mesh.tp_size)
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, rng_state(device))
    error = None
    if dist.get_rank() == 0:
        epoch, pos = batches.position(step)
        try:
            path = checkpoint.save(run_dir, step, {
                "model": model_state, "optimizer": opt_state, "scheduler": sched.state_dict(),
                "step": step, "epoch": epoch, "position_in_epoch": pos,
                "samples_seen": batches.samples_seen(step), "rng": rng, **saved_with})
            (log or logging.getLogger("minddp").info)(f"saved {path}")
        except Exception as e:  # noqa: BLE001 - every rank stops with it, below
            error = e
    kind = checkpoint.CheckpointWriteError
    together(error, what=f"save step {step}", kinds=(kind, kind))


def load_model(model, saved, mesh, path) -> None:
    """The weights of a loaded checkpoint `saved` (read from `path`) into this rank's model."""
    if not saved:  # checkpoints hold full tensors: any layout can resume any other
        return
    try:
        tp.load_full_state_dict(model, saved["model"], mesh.tp_size, mesh.tp_rank)
    except (RuntimeError, KeyError) as e:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} was written by a different model: "
            f"{str(e).splitlines()[0]} ... Use the model config it was trained with, "
            "or train.resume=none") from None


def load_training_state(saved, *, opt, sched, lr_factor, mesh, rank: int, device) -> int:
    """Optimizer, schedule position and this rank's RNG; this run's optim.* settings win.
    Returns the step (0 without a checkpoint)."""
    if not saved:
        return 0
    inner = opt.optim
    settings = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    tp.load_full_optimizer_state(opt, saved["optimizer"], mesh.tp_size, mesh.tp_rank)
    for group, mine in zip(inner.param_groups, settings):
        group.update(mine)
    restore_schedule(opt, sched, lr_factor, saved["scheduler"]["last_epoch"])
    set_rng_state(saved["rng"][rank % len(saved["rng"])], device)
    return saved["step"]


def restore_schedule(opt, sched, lr_factor, position: int) -> None:
    """Only the position comes from the checkpoint; the schedule is this run's `lr_factor`
    (optim.* and max_steps: LambdaLR's saved state would bring back the old optim.lr)."""
    sched.last_epoch = position
    factor = lr_factor(position)
    for group, base in zip(opt.optim.param_groups, sched.base_lrs):
        group["lr"] = base * factor


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device: torch.device) -> None:
    if isinstance(state, torch.Tensor):  # checkpoints before CUDA states were saved
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
