"""What a run is made of, built from its config: the model (minddp.model.build, imported here),
compiled as train.compile says, and the optimizer (the LR schedule is the loop's:
minddp.train.trainer.lr_factor)."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..model.build import build_model  # noqa: F401 - the trainer's (and `from minddp.train.build import build_model`)
from ..optim.overlap import OverlappedOptimizer
from ..optim.replicated import ReplicatedOptimizer
from ..optim.zero import ShardedOptimizer


def compile_model(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """train.compile, in place (`nn.Module.compile`: parameter names, checkpoints and evaluation see
    the same module): `whole` compiles the model's forward, which minddp.DDP has dynamo split at
    its bucket boundaries (one backward node per bucket, so buckets go out during backward);
    `blocks` compiles each transformer block (or MLP layer); `none` leaves it eager."""
    if how not in ("none", "whole", "blocks"):
        raise ConfigError(f"train.compile={how}: expected none, whole (the model) or blocks (each block)")
    if how == "whole":
        model.compile()
    elif how == "blocks":
        for block in getattr(model, "blocks", None) or getattr(model, "layers", []):
            block.compile()
    return model


def build_optimizer(model, o, device: torch.device, ddp=None, tp_group=None, tp_size: int = 1):
    """AdamW, fused where torch has the kernel (CPU and CUDA: one pass over all parameters);
    no weight decay on biases, norms and other vectors (GPT-2 practice); replicated, sharded
    (ZeRO-1, ddp.shard_optimizer) or stepped per bucket (ddp.optimizer_overlap), each with
    minddp.optim's protocol."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": other, "weight_decay": 0.0}]
    kwargs = {"lr": o.lr, "betas": (o.beta1, o.beta2), "tp_group": tp_group, "tp_size": tp_size,
              "fused": device.type in ("cpu", "cuda")}  # where torch has the kernel
    kind = (ShardedOptimizer if ddp is not None and ddp.shard_optimizer else
            OverlappedOptimizer if ddp is not None and ddp.optimizer_overlap else ReplicatedOptimizer)
    return kind(ddp, torch.optim.AdamW, groups, **kwargs)

