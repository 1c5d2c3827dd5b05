"""Which checkpoint a run resumes from (train.resume), chosen by rank 0, read by every rank: a
client of the formats (formats.load reads either).

Progress is never lost: a corrupt checkpoint (unparsable, a missing key, a failed
checksum, a tensor of the wrong shape) is named and skipped for an older one, but an I/O or
out-of-memory error (transient: the file may be fine) stops the run; a run whose checkpoints
all fail stops (exit 2) instead of starting over; a fresh start refuses a run directory that
already holds checkpoints; and a `checkpoints` link to nothing (an unmounted disk) is refused
instead of read as "no checkpoints".
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ..safety.together import together
from . import integrity
from .errors import CheckpointError, CheckpointReadError, DifferentModel
from .folders import FOLDER
from .formats import load, remove_crash_leftovers
from .store import all_checkpoints, checkpoint_dir, is_checkpoint_folder, listed

log = logging.getLogger("minddp")


def resume_run_dir(resume: str) -> Path | None:
    """The run dir a `train.resume=<folder>` names: the folder, or its parent when the folder
    is the checkpoints folder itself. None when resume is not a folder (or is a checkpoint's)."""
    p = Path(resume)
    if resume in ("none", "auto") or not p.is_dir() or is_checkpoint_folder(p):
        return None
    return p.parent if p.name == "checkpoints" or listed(p) else p


def _check_link(run_dir) -> None:
    d = checkpoint_dir(run_dir)
    if d.is_symlink() and not d.exists():
        raise CheckpointError(
            f"{d} is a symlink to {os.readlink(d)}, which does not exist (an unmounted disk?): the run's "
            "checkpoints cannot be seen. Mount it or fix the link (or remove it to start over); nothing "
            "was changed")
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"{d} is not a folder: move it away; nothing was changed")


def open_lazily(path, device) -> dict:
    """A checkpoint to load in place: a folder's state with meta tensors (FOLDER.open: its small
    files checked, its tensors left for each rank to read its part); a file, whole."""
    return FOLDER.open(path, device) if FOLDER.owns(path) else load(path, device)


def resolve(run_dir, resume: str, device, accept=None, *, opener=load, skip=(),
            failures=None) -> tuple[Path | None, dict | None]:
    """train.resume: none -> a fresh start, refused over existing checkpoints; a file -> that
    checkpoint or a clear error; auto, or this run dir (or its checkpoints folder) -> its
    newest usable checkpoint, skipping (and naming) corrupt ones; fresh (auto only) if the
    run has none. `accept(path, state)` may refuse a loaded state as corrupt (CheckpointError).
    `opener(path, device)` reads a state (`load`: whole); `skip`: paths found corrupt already,
    their reasons in `failures`."""
    _check_link(run_dir)
    found = all_checkpoints(run_dir)
    if resume == "none":
        if found:
            raise CheckpointError(
                f"train.resume=none, but the run dir {run_dir} already holds {len(found)} checkpoint(s) "
                f"(newest {found[0]}) that a fresh start would overwrite: continue it with "
                "train.resume=auto, or give this run a new directory (MINDDP_RUN_DIR or hydra.run.dir)")
        return None, None
    folder = resume_run_dir(resume)
    if folder is None and resume != "auto":
        if not os.path.exists(resume):
            raise CheckpointError(f"train.resume={resume!r}: no such checkpoint (use none, auto or a path)")
        return _accepted(Path(resume), opener(resume, device), accept)
    if folder is not None and os.path.realpath(folder) != os.path.realpath(run_dir):
        raise CheckpointError(
            f"train.resume={resume} continues the run dir {folder}, but this run writes to {run_dir} "
            "(MINDDP_RUN_DIR or hydra.run.dir): unset that, or give train.resume a checkpoint file")
    if not found:
        if folder is not None:
            raise CheckpointError(f"no checkpoint in {checkpoint_dir(run_dir)}: nothing to resume. Start "
                                  "that run dir fresh with train.resume=auto")
        log.info(f"no checkpoint in {checkpoint_dir(run_dir)}: starting fresh")
        return None, None
    return _newest_usable(run_dir, found, device, accept, opener, skip, list(failures or ()))


def _accepted(path: Path, state: dict, accept) -> tuple[Path, dict]:
    """A state to resume from: all a resume reads (integrity.REQUIRED), and what `accept` checks."""
    if problem := integrity.layout_problem(state):
        raise CheckpointError(f"checkpoint {path} is corrupt: {problem}")
    if accept is not None:
        accept(path, state)
    return path, state


def _newest_usable(run_dir, found: list[Path], device, accept, opener, skip,
                   failures: list) -> tuple[Path, dict]:
    for path in found:
        if str(path) in skip:
            continue
        try:
            return _accepted(path, opener(path, device), accept)
        except CheckpointError as e:  # corrupt: an older one may do; transient errors propagate
            failures.append(str(e))
            log.warning(f"{e}; trying the previous checkpoint")
    raise CheckpointError(
        f"train.resume=auto: none of the {len(found)} checkpoints in {checkpoint_dir(run_dir)} can "
        "be read, and starting over would lose the run's progress. Each one:\n  "
        + "\n  ".join(failures) + "\nNothing was changed. Resume from a good copy with "
        "train.resume=<path>, or move the checkpoints away to start over")


def resolve_agreed(run_dir, resume: str, device, accept=None, *, into,
                   check=None) -> tuple[Path | None, dict | None]:
    """`resolve` on rank 0, whose choice is broadcast: on a shared filesystem with attribute
    caching, ranks listing the directory themselves could resume from different steps. Any
    failure, on any rank, is raised on every rank (never a rank waiting for a dead peer).
    A folder's tensors are not read by the choice: rank 0 checks its small files and sizes, then
    every rank reads its own part in place (`into(path, state)`, a collective); a part damaged on
    any rank makes the checkpoint corrupt on every rank, and the previous one is chosen
    (train.resume=auto or a run dir) or the run stops (a path). `check(path, state)`, every
    rank, before `into`: may refuse the chosen state (a changed config: its error stops the run,
    it is no fallback)."""
    skip, failures = set(), []
    while True:
        path, state = _agreed_choice(run_dir, resume, device, accept, open_lazily, skip, failures)
        if path is None:
            return path, state
        if check is not None:
            check(path, state)
        error = None
        try:
            into(path, state)
        except Exception as e:  # noqa: BLE001 - agreed below
            error = e
        try:
            together(error, what="resume", kinds=(CheckpointError, CheckpointReadError))
        except CheckpointError as e:  # corrupt: an older one may do, where resume lets us choose
            if isinstance(e, DifferentModel) or (resume_run_dir(resume) is None and resume != "auto"):
                raise
            failures.append(str(e))
            skip.add(str(path))
            log.warning(f"{e}; trying the previous checkpoint")
            continue
        return path, state


def _agreed_choice(run_dir, resume, device, accept, opener, skip, failures):
    """One choice: rank 0's, broadcast; every other rank opens it and checks it the same way."""
    single = not dist.is_initialized() or dist.get_world_size() == 1
    chosen = dict(opener=opener, skip=skip, failures=failures)
    if single:
        if not skip:
            remove_crash_leftovers(run_dir)
        return resolve(run_dir, resume, device, accept, **chosen)
    path, state, error = None, None, None
    choice = [None]
    if dist.get_rank() == 0:
        try:  # rank 0's failures, the clean-up's included, reach every rank (never a peer left waiting)
            if not skip:
                remove_crash_leftovers(run_dir)
            path, state = resolve(run_dir, resume, device, accept, **chosen)
            choice = [str(path) if path else None]
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = e
    dist.broadcast_object_list(choice, src=0)
    if dist.get_rank() != 0 and error is None and choice[0]:
        try:
            path, state = _accepted(Path(choice[0]), opener(choice[0], device), accept)
        except Exception as e:  # noqa: BLE001
            error = e
    together(error, what="resume", kinds=(CheckpointError, CheckpointReadError))
    return path, state


def shape_check(model_cfg, build_model, vocab_size: int):
    """An `accept(path, state)` for checkpoint.resolve: with the saved model config equal to
    this run's (else resume/check.py refuses it, with a diff), every model and optimizer tensor
    must have this model's shape. Built on the meta device: no memory, any tp layout."""
    with torch.device("meta"):
        model = build_model(model_cfg, vocab_size)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    order = [p.shape for p in params if p.dim() >= 2] + [p.shape for p in params if p.dim() < 2]
    current = OmegaConf.to_container(model_cfg, resolve=True)

    def accept(path, state) -> None:
        saved = (state.get("config") or {}).get("model")
        if saved is not None and saved != current:
            return
        problem = integrity.shape_problem(state["model"], shapes, "model") or integrity.optimizer_problem(
            state["optimizer"], order)
        if problem:
            raise CheckpointError(f"checkpoint {path} is corrupt: {problem}, under the same model config")
    return accept
