"""What a checkpoint holds of a training run, and how it comes back: model, optimizer, schedule,
data position and RNG, written at any dp/tp layout (sharded or not) and loadable at any other."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ...parallel import tensor_parallel as tp
from ..checkpoint import CheckpointError
from ..checkpoint.files import FILE
from ..checkpoint.folders import FOLDER, BackgroundSave
from ..metrics import flight_recorder


def save(run_dir, step: int, *, model, opt, sched, batches, mesh, device, saved_with: dict,
         folder: bool = False, background: bool = False, log=None, pause=None,
         timeout_s: float = 1800.0) -> Path | BackgroundSave:
    """Every rank, at the same point: what a checkpoint holds of this run, saved in a format's
    own way (checkpoint/files.py, folders.py). A file (0.4's format): full tensors gathered over
    tp (and ZeRO-1's shards over dp), rank 0 writes. A folder (`folder`): each rank writes what it
    holds, nothing gathered over dp; with `background` the write runs beside the next step and
    the BackgroundSave is returned, to be committed after it (`commit`). Either way a failed
    write raises on every rank. Positions are global (samples seen), so any dp can resume.
    `saved_with`: the run's config and data; `pause`: run before a background write (faults)."""
    flight_recorder.set_context(phase="checkpoint")
    opt.wait_params()
    # tp splits tensors: with tp > 1 both formats write whole ones (gathered over tp, and a
    # ZeRO-1 state over dp too); with tp = 1 a folder takes each rank's own tensors as they are
    own = folder and mesh.tp_size == 1
    model_state = model.state_dict() if own else tp.full_state_dict(model, mesh.tp_group, mesh.tp_size)
    opt_state = opt.sharded_state_dict() if own else tp.full_optimizer_state(opt, model, mesh.tp_group,
                                                                              mesh.tp_size)
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, rng_state(device))
    epoch, pos = batches.position(step)
    everything = {"model": model_state, "optimizer": opt_state, "scheduler": sched.state_dict(),
                  "step": step, "epoch": epoch, "position_in_epoch": pos,
                  "samples_seen": batches.samples_seen(step), "rng": rng, **saved_with}
    if folder and background:
        return FOLDER.save_in_background(run_dir, step, everything, timeout_s=timeout_s, before_write=pause)
    path = (FOLDER if folder else FILE).save(run_dir, step, everything)
    _said_saved(path, log)
    return path


def commit(saving: BackgroundSave, log=None) -> Path:
    """Every rank: a background save committed (checksums read back, rank 0's rename)."""
    path = saving.commit()
    _said_saved(path, log)
    return path


def _said_saved(path: Path, log) -> None:
    if log is not None and dist.get_rank() == 0:
        log(f"saved {path}")


def load_model(model, saved, mesh, path) -> None:
    """The weights of a loaded checkpoint `saved` (read from `path`) into this rank's model."""
    if not saved:  # checkpoints hold full tensors: any layout can resume any other
        return
    try:
        tp.load_full_state_dict(model, saved["model"], mesh.tp_size, mesh.tp_rank)
    except (RuntimeError, KeyError) as e:
        raise CheckpointError(
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
