"""The models minddp trains: a small GPT (byte-level, tied embeddings) and an MLP.

Both take a batch of token ids `idx` (B, T) and return logits (B, T, vocab); the
trainer computes the cross-entropy. Keeping one interface lets every data set
drive either model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    # gelu: torch's exact GELU (erf) | gelu_tanh: its tanh approximation, what GPT-2 computes
    # (Hugging Face's activation_function gelu_new)
    activation: str = "gelu"


GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}  # GPTConfig.activation -> F.gelu's argument


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        if str(cfg.activation) not in GELU_APPROXIMATE:
            raise ValueError(f"activation={cfg.activation!r}: expected one of {', '.join(GELU_APPROXIMATE)}")
        self.approximate = GELU_APPROXIMATE[str(cfg.activation)]

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate=self.approximate)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied embeddings
        self.apply(self._init)
        # GPT-2: scale the residual projections by depth
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@dataclass
class MLPConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_embd: int = 64
    hidden: int = 256
    n_layer: int = 2


class MLP(nn.Module):
    """A per-position MLP over token embeddings (a bigram-style model): small and fast."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        dims = [cfg.n_embd] + [cfg.hidden] * cfg.n_layer
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(dims[-1], cfg.vocab_size)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def generate(model, ids: list[int], tokens: int, temperature: float = 1.0, top_k: int | None = None,
             block_size: int = 128, vocab: int | None = None) -> list[int]:
    """`tokens` ids after the prompt (nanoGPT's GPT.generate: temperature, top-k; 0: greedy);
    `vocab`: only ids below it (those the tokenizer decodes)."""
    x = torch.tensor([ids or [0]], dtype=torch.long)
    for _ in range(tokens):
        logits = model(x[:, -block_size:])[:, -1, :vocab].float()
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits[logits < kth] = -float("inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1)
        x = torch.cat([x, nxt], dim=1)
    return x[0, len(ids or [0]):].tolist()
