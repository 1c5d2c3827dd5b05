"""The loss every measurement runs: next-token cross-entropy of a (batch, block + 1) token tensor.
The models themselves come from the caller (the tools build minddp.train's GPT)."""

from __future__ import annotations

from torch.nn import functional as F


def lm_loss(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
