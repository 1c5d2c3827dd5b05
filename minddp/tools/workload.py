"""The benchmarks' workload, defined once: the GPT they time and its language-model loss."""

from __future__ import annotations

from torch.nn import functional as F

from ..train.model import GPTConfig


def bench_gpt(n_layer: int, n_embd: int, n_head: int = 6, block_size: int = 128) -> GPTConfig:
    """The GPT of bench-ddp and timeline (bytes vocabulary), sized by their --n-layer/--n-embd."""
    return GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size)


def lm_loss(model, x):
    """Next-token cross-entropy of a (batch, block + 1) token tensor."""
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
