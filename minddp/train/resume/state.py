"""What a checkpoint holds of a training run, and how it comes back: model, optimizer, schedule,
data position and RNG, written at any dp/tp layout (sharded or not) and loadable at any other."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...parallel import tensor_parallel as tp
from ..checkpoint import files as checkpoint
from ..checkpoint import folders
from ..metrics import flight_recorder
from ..safety.together import together


def save(run_dir, step: int, *, model, opt, sched, batches, mesh, device, saved_with: dict,
         folder: bool = False, background: bool = False, log=None, pause=None) -> FolderSave | None:
    """Every rank, at the same point. A file (0.4's format): full tensors gathered over tp (and
    ZeRO-1's shards over dp), then rank 0 writes atomically. A folder (`folder`, through DCP):
    each rank writes what it holds, nothing gathered over dp; with `background` the write runs
    beside the next step and the save is returned, to be `commit`ted after it. Either way a
    failed write raises on every rank (none waits for rank 0). Positions are global (samples
    seen), so any dp can resume. `saved_with`: the run's config and data."""
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
    if not folder:
        _said_saved(_save_file(run_dir, step, everything), log)
        return None
    saving = _start_folder(run_dir, step, everything, background, pause)
    if background:
        return saving
    commit(saving, log)
    return None


_KINDS = (checkpoint.CheckpointWriteError,) * 2  # any failure of a save stops every rank as one


def _said_saved(path: Path, log) -> None:
    if dist.get_rank() == 0:
        (log or logging.getLogger("minddp").info)(f"saved {path}")


def _save_file(run_dir, step: int, everything: dict) -> Path:
    path, error = None, None
    if dist.get_rank() == 0:
        try:
            path = checkpoint.save(run_dir, step, everything)
        except Exception as e:  # noqa: BLE001 - every rank stops with it, below
            error = e
    return together(error, path, what=f"save step {step}", kinds=_KINDS)[0]


@dataclass
class FolderSave:
    """A folder checkpoint on its way: its temporary folder, and the future of the background
    write while its staged tensors are written."""

    final: Path
    tmp: Path
    what: str
    writing: object = None


def _start_folder(run_dir, step: int, everything: dict, background: bool, pause=None) -> FolderSave:
    """Rank 0 starts the folder (the small state), every rank writes its tensors (DCP), or
    stages a copy of them and writes it in the background."""
    final = checkpoint.checkpoint_dir(run_dir) / f"ckpt_{step:08d}"
    what = f"save step {step}"
    small, tensors = folders.split(everything)
    saving = FolderSave(final, _on_rank0(lambda: folders.begin(final), final, what), what)
    with _cleaned_up_on_error(saving):
        _on_rank0(lambda: folders.write_small(saving.tmp, small), final, what)
        if not background:
            folders.write_tensors(saving.tmp, tensors)
            return saving
        staged, error = None, None
        try:
            staged = folders.stage(tensors)
        except Exception as e:  # noqa: BLE001 - out of host memory on one rank: every rank stops
            error = e
        together(error, what=what, kinds=_KINDS)
        saving.writing = folders.write_in_background(saving.tmp, staged, before=pause)
    return saving


def commit(saving: FolderSave, log=None) -> None:
    """Every rank: the tensors written, the files' checksums (split between the ranks), rank 0's
    rename. A failure anywhere stops every rank and leaves the previous checkpoint as it was."""
    with _cleaned_up_on_error(saving):
        if saving.writing is not None:
            saving.writing.result()
            saving.writing = None
        names = _on_rank0(lambda: sorted(os.listdir(saving.tmp)), saving.final, saving.what)
        sums, error = {}, None
        try:
            mine = folders.my_share(names, dist.get_rank(), dist.get_world_size())
            sums = folders.checksums(saving.tmp, mine)
        except FileNotFoundError as e:
            error = checkpoint.CheckpointWriteError(
                f"rank {dist.get_rank()} cannot see {e.filename}, which another rank wrote: "
                "train.ckpt_format=dcp needs a run dir every rank sees (a shared filesystem); "
                "with node-local disks use train.ckpt_format=file")
        except OSError as e:
            error = checkpoint.write_error(saving.final, e)
        parts = together(error, sums, what=saving.what, kinds=_KINDS)
        merged = {k: v for part in parts for k, v in part.items()}
        _on_rank0(lambda: folders.publish(saving.tmp, saving.final, merged), saving.final, saving.what)
    _said_saved(saving.final, log)


def end(saving: FolderSave, timeout_s: float) -> str | None:
    """A background save met by a way out other than its commit (an error, on any rank, maybe on
    one alone): no collective on the training's groups. Each rank waits for its own write (DCP's
    collectives run on the write's own group, between the write threads); then rank 0 commits the
    folder alone (checksumming every rank's files itself) if its DCP save completed, which means
    every rank's did, else removes it. Returns rank 0's closing line (None on the others)."""
    step = int(saving.final.name.split("_")[-1])
    said = f"the checkpoint of step {step}, written in the background when the run stopped"
    try:
        if saving.writing is not None:
            saving.writing.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return (f"{said}: still being written after {timeout_s:.0f} s (train.timeout_s), left as "
                f"{saving.tmp.name}, which the next start removes") if dist.get_rank() == 0 else None
    except BaseException as e:  # noqa: BLE001 - its failure is why it is removed, said below
        return _removed(saving, said, e)
    if dist.get_rank() != 0:
        return None
    try:
        names = sorted(os.listdir(saving.tmp))
        folders.publish(saving.tmp, saving.final, folders.checksums(saving.tmp, names))
    except Exception as e:  # noqa: BLE001 - a folder that cannot be committed is removed
        return _removed(saving, said, e)
    return f"{said}: completed and committed as {saving.final}"


def _removed(saving: FolderSave, said: str, e: BaseException) -> str | None:
    if dist.get_rank() != 0:
        return None
    shutil.rmtree(saving.tmp, ignore_errors=True)
    if isinstance(e, dcp.CheckpointException):
        e = checkpoint.first_failure(e)
    prev = checkpoint.latest(saving.final.parent.parent)
    return (f"{said}: removed ({type(e).__name__}: {e}); the newest checkpoint is "
            f"{prev if prev else 'none'}")


@contextmanager
def _cleaned_up_on_error(saving: FolderSave):
    """DCP's failures as a CheckpointWriteError (DCP raises them on every rank); rank 0 removes
    the temporary folder of a save that failed."""
    try:
        try:
            yield
        except dcp.CheckpointException as e:
            raise checkpoint.write_error(saving.final, checkpoint.first_failure(e)) from None
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(saving.tmp, ignore_errors=True)
        raise


def _on_rank0(action, final: Path, what: str):
    """`action()` on rank 0, its result on every rank; its failure raised on every rank (a
    failed write, torch.save's full disk included, as a CheckpointWriteError)."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = action()
        except Exception as e:  # noqa: BLE001 - every rank stops with it, below
            failed_write = isinstance(e, OSError) or checkpoint.is_write_failure(e)
            error = checkpoint.write_error(final, e) if failed_write else e
    return together(error, result, what=what, kinds=_KINDS)[0]


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
