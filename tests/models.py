"""The engine tests' reference: a small MLP, a model with buffers, seeded global batches and
per-rank shards, and the comparison of two models' parameters."""

from __future__ import annotations

import torch
from torch import nn
from torch.testing import assert_close

B = 4  # per-rank batch


class WithBN(nn.Module):
    """A model with buffers (BatchNorm's running statistics)."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


class MLP(nn.Module):
    def __init__(self, d_in=8, width=32, d_out=4, depth=4):
        super().__init__()
        dims = [d_in] + [width] * (depth - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def batch(step, world_size, d_in=8, d_out=4, dtype=torch.float32):
    """The global batch of a step: the same on every rank, world_size * B rows."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world_size * B, d_in, generator=g, dtype=dtype)
    y = torch.randn(world_size * B, d_out, generator=g, dtype=dtype)
    return x, y


def shard(t, rank):
    return t[rank * B : (rank + 1) * B]


def params_of(model):
    m = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def assert_same_params(a, b, atol=1e-6, rtol=1e-5):
    assert a.keys() == b.keys()
    for n in a:
        assert_close(a[n], b[n], atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n}: {m}")
