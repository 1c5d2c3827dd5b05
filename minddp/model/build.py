"""The model for a `model=` config group (its schema is the model's own config + name), refused
with one line when its fp32 weights would not fit this machine's memory."""

from __future__ import annotations

import dataclasses
import os

import torch

from ..errors import ConfigError
from .gpt import GPT, MLP, GPTConfig, MLPConfig


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
