"""The tools' workloads, defined once: named GPT presets, a batch of tokens for one, the
language-model loss, and the trainer overrides that give the same model."""

from __future__ import annotations

import torch

from ..perf.workload import lm_loss  # noqa: F401  (the tools' loss is the measurements')
from ..train.model import GPT, GPTConfig

GPT_PRESETS = {  # GPTConfig fields; vocabulary 256 (bytes)
    # bench-ddp, timeline, scaling, calibrate and bench-memory: one GPT behind every study
    "gpt-10.8M": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 128},
    "gpt-50M": {"n_layer": 7, "n_head": 12, "n_embd": 768, "block_size": 128},  # bench-memory's larger
    "gpt-trainer": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},  # bench-trainer
    "gpt-small": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32},  # per-bucket CPU cost
    "gpt-tiny": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},  # the tests'
}
STUDY = "gpt-10.8M"
STUDY_BATCH = (8, 2)  # the studies' global batch and micro-batch (scaling, calibrate)


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


def overrides(cfg: dict) -> list[str]:
    """train.py's model overrides for the same GPT."""
    return [f"model.{k}={v}" for k, v in cfg.items()]
