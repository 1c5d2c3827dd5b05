"""What a run is made of, built from its config: the model (if it fits), the optimizer, the LR schedule."""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from ..errors import ConfigError
from ..optim.overlap import OverlappedOptimizer
from ..optim.replicated import ReplicatedOptimizer
from ..optim.zero import ShardedOptimizer
from .model import GPT, MLP, GPTConfig, MLPConfig


def build_model(m, vocab_size: int) -> torch.nn.Module:
    """The model for a `model=` config group (its schema is the model's own config + name).
    A model larger than this machine's memory is a ConfigError naming its size, not a build
    that runs for hours (model.n_layer=10**30) or dies in the allocator."""
    if (problem := size_problem(m, vocab_size)) is not None:
        raise ConfigError(problem)
    cls, cfg_cls = (GPT, GPTConfig) if m.name == "gpt" else (MLP, MLPConfig)
    # a key an older config lacks (a checkpoint's, before model.activation) keeps its default
    kwargs = {f.name: m[f.name] if f.name in m else f.default for f in dataclasses.fields(cfg_cls)}
    return cls(cfg_cls(**{**kwargs, "vocab_size": vocab_size}))


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


def parameter_count(m, vocab_size: int) -> int:
    """The parameters build_model makes for these sizes, counted without building anything."""
    e = m.n_embd
    if m.name == "gpt":
        bias = e if m.bias else 0  # per LayerNorm and per Linear output, where the model has biases
        layer = 12 * e * e + 2 * (e + bias) + 9 * bias  # two LayerNorms; qkv, proj, fc, fc_proj's biases
        return (vocab_size + m.block_size) * e + m.n_layer * layer + e + bias  # the head is tied
    h = m.hidden
    return vocab_size * e + (e * h + h) + (m.n_layer - 1) * (h * h + h) + h * vocab_size + vocab_size


def memory_bytes() -> int:
    """This machine's physical memory (a model is built on the host before it moves)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size_problem(m, vocab_size: int) -> str | None:
    """One line when the fp32 weights alone would not fit in this machine's memory."""
    n = parameter_count(m, vocab_size)
    if 4 * n <= memory_bytes():
        return None
    sizes = ", ".join(f"{k}={m[k]}" for k in ("n_layer", "n_embd", "hidden", "block_size") if k in m)
    return (f"model={m.name} with {sizes} and a vocabulary of {vocab_size} has {n:.3g} parameters: "
            f"{4 * n:.3g} bytes of fp32 weights, more than this machine's {memory_bytes() / 2**30:.0f} GiB; "
            "choose smaller model sizes")


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


def lr_factor(step: int, o, max_steps: int) -> float:
    """Linear warmup, then cosine decay from lr to min_lr at max_steps (a factor of lr)."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps))
    return (o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))) / o.lr
