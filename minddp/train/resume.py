"""Resuming, as a user sees it: the exact command that continues a stopped run, and the
check that a loaded checkpoint fits this model (a tensor of the wrong shape under an
unchanged model config is a corrupt file: the previous checkpoint is used instead).
"""

from __future__ import annotations

import os
import shlex
import sys

import torch
from omegaconf import OmegaConf

from . import integrity
from .checkpoint import CheckpointError

# overrides that must not come back on resume: it would stop again at once, or inject a fault again
_DROP = ("train.resume=", "train.stop_at_step=", "train.fault_", "+train.resume=", "++train.resume=")


def resume_command(run_dir, argv=None, env=None) -> str:
    """The command that continues this run in its run dir (this launch's overrides kept)."""
    argv = sys.argv if argv is None else argv
    env = os.environ if env is None else env
    script = argv[0] if argv else "train.py"
    args = [a for a in argv[1:] if not a.startswith(_DROP)] + [f"train.resume={run_dir}"]
    if "TORCHELASTIC_RUN_ID" not in env:
        return shlex.join(["python", script, *args])
    if env.get("GROUP_WORLD_SIZE", "1") == "1":
        return shlex.join(["torchrun", "--standalone", f"--nproc_per_node={env.get('LOCAL_WORLD_SIZE', '1')}",
                           script, *args])
    return "your launch command (on every node) with: " + shlex.join([script, *args])


def shape_check(model_cfg, build_model, vocab_size: int):
    """An `accept(path, state)` for checkpoint.resolve: with the saved model config equal to
    this run's (else resume_check refuses it, with a diff), every model and optimizer tensor
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
        problem = integrity.shape_problem(state["model"], shapes, "model") or _optimizer_problem(
            state["optimizer"], order)
        if problem:
            raise CheckpointError(f"checkpoint {path} is corrupt: {problem}, under the same model config")
    return accept


def _optimizer_problem(opt: dict, shapes: list) -> str | None:
    count = sum(len(g.get("params", ())) for g in opt["param_groups"] if isinstance(g, dict))
    if count != len(shapes):
        return f"the optimizer state is for {count} parameters, this model has {len(shapes)}"
    for idx, st in opt["state"].items():
        if not (isinstance(idx, int) and 0 <= idx < len(shapes) and isinstance(st, dict)):
            return f"the optimizer state has an entry {idx!r} that is no parameter's"
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(shapes[idx]):
                return (f"optimizer state {idx}.{key}: shape {tuple(v.shape)}, its parameter's is "
                        f"{tuple(shapes[idx])}")
    return None
