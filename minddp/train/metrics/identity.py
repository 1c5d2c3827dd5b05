"""A run's identity: the flat keys that W&B's config and run.json hold, so runs can be grouped
and charted by world size, variant, repeat, ... (the Hydra config alone does not say them).

    world_size dp tp nodes nproc_per_node backend device device_type num_params accumulation
    global_batch tokens_per_step buckets variant repeat scaling torch_version minddp_version
    git_commit

and the run's default name, unique within a study: model, layout, cap, variant, repeat.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

import minddp

from ...engine.options import DEFAULT_BUCKET_CAP_MB

SOURCE = Path(minddp.__file__).resolve().parents[1]  # the checkout minddp runs from


def variant(ddp_cfg) -> str:
    """ddp, zero1 (ddp.shard_optimizer) or overlap (ddp.optimizer_overlap): what the study compares."""
    return "zero1" if ddp_cfg.shard_optimizer else "overlap" if ddp_cfg.optimizer_overlap else "ddp"


def layout(world_size: int) -> tuple[int, int]:
    """(nodes, processes per node), from what the launcher says: torchrun's local size and
    its agents (one per node), else Slurm's node count, else one node."""
    env = os.environ
    if env.get("LOCAL_WORLD_SIZE"):
        per_node = int(env["LOCAL_WORLD_SIZE"])
        return int(env.get("GROUP_WORLD_SIZE") or -(-world_size // per_node)), per_node
    if env.get("SLURM_NNODES"):
        nodes = int(env["SLURM_NNODES"])
        return nodes, -(-world_size // nodes)
    return 1, world_size


def device_name(device: torch.device) -> str:
    """The GPU's name (`NVIDIA H100 80GB HBM3`), or cpu."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def git_commit(root: Path = SOURCE) -> str | None:
    """The commit of the checkout minddp runs from (`git rev-parse`: worktrees, packed refs and
    detached heads are git's business); None without git, outside a checkout, or where `root`
    is not the top of one (an installed minddp inside some other repository)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "--verify", "HEAD"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    if out.returncode or len(lines) != 2 or Path(lines[0]).resolve() != Path(root).resolve():
        return None
    return lines[1]


def identity(cfg, world_size: int, dims, backend: str, device: torch.device, num_params: int,
             accumulation: int, buckets: int) -> dict:
    nodes, per_node = layout(world_size)
    global_batch = cfg.train.micro_batch_size * accumulation * dims.dp
    return {"world_size": world_size, "dp": dims.dp, "tp": dims.tp, "nodes": nodes,
            "nproc_per_node": per_node, "backend": backend, "device": device_name(device),
            "device_type": device.type, "num_params": num_params, "accumulation": accumulation,
            "global_batch": global_batch, "tokens_per_step": global_batch * cfg.model.block_size,
            "buckets": buckets, "variant": variant(cfg.ddp), "repeat": cfg.wandb.repeat,
            "scaling": cfg.train.scaling, "torch_version": torch.__version__,
            "minddp_version": minddp.__version__, "git_commit": git_commit()}


def run_name(cfg, ident: dict) -> str:
    """wandb.name, else gpt-ws2-dp2-tp1-mb8-cap25-ddp-r0 (-weak for weak scaling): the
    variant and the repeat in it, so a study's runs never share a name."""
    if cfg.wandb.name:
        return cfg.wandb.name
    weak = "-weak" if ident["scaling"] == "weak" else ""
    cap = cfg.ddp.bucket_cap_mb or DEFAULT_BUCKET_CAP_MB
    return (f"{cfg.model.name}-ws{ident['world_size']}-dp{ident['dp']}-tp{ident['tp']}"
            f"-mb{cfg.train.micro_batch_size}-cap{cap:g}-{ident['variant']}{weak}"
            f"-r{ident['repeat']}")
