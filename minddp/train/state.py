"""What a checkpoint holds of a Trainer, and how it comes back: model, optimizer, schedule,
data position and RNG, written at any dp/tp layout (sharded or not) and loadable at any other."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import tensor_parallel as tp
from . import checkpoint, flight_recorder


def save(trainer, step: int) -> None:
    """Collectives first, on every rank (full tensors gathered over tp, RNG states), then rank 0
    writes atomically. Positions are global (samples seen), so any dp can resume."""
    flight_recorder.set_context(phase="checkpoint")
    trainer.opt.wait_params()
    mesh, info = trainer.mesh, trainer.info
    model_state = tp.full_state_dict(trainer.model, mesh.tp_group, mesh.tp_size)
    opt_state = tp.full_optimizer_state(trainer.opt, trainer.model, mesh.tp_group, mesh.tp_size)
    rng = [None] * info.world_size
    dist.all_gather_object(rng, rng_state(info.device))
    failure, error = [None], None
    if info.is_main:
        epoch, pos = trainer.batches.position(step)
        try:
            path = checkpoint.save(trainer.run_dir, step, {
                "model": model_state, "optimizer": opt_state, "scheduler": trainer.sched.state_dict(),
                "step": step, "epoch": epoch, "position_in_epoch": pos,
                "samples_seen": trainer.batches.samples_seen(step), "rng": rng,
                "config": trainer.run_config(), "data": trainer.data_info.as_dict()})
            trainer.tracker.info(f"saved {path}")
        except Exception as e:  # noqa: BLE001 - every rank stops with it, none waits for rank 0
            failure, error = [f"{type(e).__name__}: {e}"], e
    dist.broadcast_object_list(failure, src=0)
    if error is not None:
        raise error
    if failure[0]:
        raise checkpoint.CheckpointWriteError(f"rank 0 could not save step {step}: {failure[0]}")


def load_model(trainer, state) -> None:
    if not state:  # checkpoints hold full tensors: any layout can resume any other
        return
    try:
        tp.load_full_state_dict(trainer.model, state["model"], trainer.mesh.tp_size, trainer.mesh.tp_rank)
    except (RuntimeError, KeyError) as e:
        raise checkpoint.CheckpointError(
            f"checkpoint {trainer.ckpt_path} was written by a different model: "
            f"{str(e).splitlines()[0]} ... Use the model config it was trained with, "
            "or train.resume=none") from None


def load_training_state(trainer, state) -> int:
    """Optimizer, schedule position and RNG; this run's optim.* settings win. Returns the step."""
    if not state:
        return 0
    inner = trainer.opt.optim
    settings = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    tp.load_full_optimizer_state(trainer.opt, state["optimizer"], trainer.mesh.tp_size, trainer.mesh.tp_rank)
    for group, mine in zip(inner.param_groups, settings):
        group.update(mine)
    restore_schedule(trainer, state["scheduler"]["last_epoch"])
    set_rng_state(state["rng"][trainer.info.rank % len(state["rng"])], trainer.info.device)
    return state["step"]


def restore_schedule(trainer, position: int) -> None:
    """Only the position comes from the checkpoint; the schedule is this run's optim.* and
    max_steps (LambdaLR's saved state would bring back the old optim.lr)."""
    trainer.sched.last_epoch = position
    factor = trainer.lr_factor(position)
    for group, base in zip(trainer.opt.optim.param_groups, trainer.sched.base_lrs):
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
