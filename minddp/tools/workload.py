"""The tools' models: minddp.train's GPT built from perf's named presets (perf/workload.py)."""

from __future__ import annotations

import torch

from ..perf.workload import GPT_PRESETS, STUDY, STUDY_BATCH, compiled, lm_loss, overrides  # noqa: F401
from ..train.model import GPT, GPTConfig


def bench_gpt(n_layer: int, n_embd: int) -> GPTConfig:
    """The study GPT resized by bench-ddp's and timeline's --n-layer/--n-embd."""
    return GPTConfig(**{**GPT_PRESETS[STUDY], "n_layer": n_layer, "n_embd": n_embd})


def build(fields: dict, device, batch: int, seed: int = 0) -> tuple[GPT, torch.Tensor]:
    """(the GPT of these GPTConfig fields, a (batch, block + 1) batch of tokens), seeded alike on
    every rank."""
    cfg = GPTConfig(**fields)
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    return model, torch.randint(0, 256, (batch, cfg.block_size + 1), device=device)
