"""The workloads every measurement runs, defined once: named GPT presets (GPTConfig fields; the
models themselves come from the caller: the tools build minddp.train's GPT), the studies' batch,
the trainer overrides for the same GPT, the loss (next-token cross-entropy of a
(batch, block + 1) token tensor), and a model compiled whole or block by block."""

from __future__ import annotations

import torch
from torch.nn import functional as F

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


def overrides(cfg: dict) -> list[str]:
    """train.py's model overrides for the same GPT."""
    return [f"model.{k}={v}" for k, v in cfg.items()]


def lm_loss(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def compiled(model, how: str, backend: str = "inductor"):
    """`model`: one graph, which a DDP wrapper has dynamo split at its bucket boundaries (one
    backward node per bucket); `blocks`: one graph per transformer block, hooks fire block by block."""
    if how == "model":
        return torch.compile(model, backend=backend)
    if how == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend)
    return model
