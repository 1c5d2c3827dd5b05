"""A small GPT-2 made with `transformers` and saved as save_pretrained does (no Hub access here),
and the comparison of its logits with minddp's: shared by the tests of minddp export and
model.init_from (tests/unit/test_hf_gpt2.py, test_hf_runs.py, tests/e2e/test_hf_cli.py)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

SIZES = {"vocab_size": 64, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 4}
TOLERANCE = 1e-5  # minddp's logits vs transformers', float32 on CPU (README: To and from Hugging Face)


def gpt2(seed: int = 0, **config):
    """A GPT2LMHeadModel of SIZES (or `config`'s), every tensor moved off its initial value (a
    bias left at zero or a LayerNorm at one would hide a swapped or missing tensor)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(**{**SIZES, "bos_token_id": 0, "eos_token_id": 0, **config})
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def saved(folder, seed: int = 0, **config):
    """gpt2(...) written to `folder` by save_pretrained; returns the model."""
    model = gpt2(seed, **config)
    model.save_pretrained(folder)
    return model


def load(folder):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(folder).eval()


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits  # minddp's GPT, or transformers'


@torch.no_grad()
def mean_loss(model, batches) -> float:
    """The trainer's loss of one step: the mean over its micro-batches of the cross-entropy."""
    return (sum(F.cross_entropy(logits(model, x).flatten(0, 1), y.flatten()) for x, y in batches)
            / len(batches)).item()


def ids(n: int = 3, length: int = 16, vocab: int = SIZES["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(7))
