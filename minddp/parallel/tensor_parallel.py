"""Megatron-style tensor parallelism for the GPT: column- and row-parallel linears.

Inside one tensor-parallel (tp) group every rank holds a slice of each big
matrix and the same batch. An attention or MLP block is one column-parallel
linear (output features split: QKV, or the first MLP linear) followed by one
row-parallel linear (input features split: the output projections):

    x (replicated) -> f -> column-parallel -> local heads / gelu -> row-parallel -> g -> + bias

f is identity forward / all-reduce backward; g is all-reduce forward / identity
backward: one all-reduce per block each way. Embeddings, norms and the head
stay replicated; because f sums the input gradient over the tp group, their
gradients come out whole and identical on every tp rank.

`parallelize_gpt` slices an already-initialised unsplit GPT, so a tp=2 model
starts from exactly the weights a tp=1 model with the same seed has. Parameter
names stay those of the unsplit model, and `full_state_dict` /
`load_full_state_dict` convert to and from full tensors, so checkpoints do not
depend on the layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from . import gradnorm

# ----------------------------------------------------------- the f / g pair


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


# ------------------------------------------------------- slicing (pure logic)


def shard(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int, parts: int = 1) -> torch.Tensor:
    """This rank's slice of `full` along `dim`. With parts=3 (fused QKV) each of q, k, v
    is split separately, so every rank gets whole heads of all three."""
    pieces = full.chunk(parts, dim=dim)
    return torch.cat([p.chunk(tp_size, dim=dim)[tp_rank] for p in pieces], dim=dim).clone()


def unshard(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's slice, in tp-rank order."""
    per_rank = [s.chunk(parts, dim=dim) for s in shards]
    return torch.cat([torch.cat([r[p] for r in per_rank], dim=dim) for p in range(parts)], dim=dim)


# --------------------------------------------------------------- the layers


class ColumnParallelLinear(nn.Module):
    """y[..., this rank's outputs] = f(x) @ W_shard^T + b_shard."""

    def __init__(self, full: nn.Linear, group, tp_size: int, tp_rank: int, parts: int = 1):
        super().__init__()
        self.group, self.parts = group, parts
        self.weight = nn.Parameter(shard(full.weight.detach(), 0, tp_size, tp_rank, parts))
        self.bias = (nn.Parameter(shard(full.bias.detach(), 0, tp_size, tp_rank, parts))
                     if full.bias is not None else None)
        _mark(self.weight, 0, parts)
        if self.bias is not None:
            _mark(self.bias, 0, parts)

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = g(x[..., this rank's inputs] @ W_shard^T) + b (bias added once, after the sum)."""

    def __init__(self, full: nn.Linear, group, tp_size: int, tp_rank: int):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(shard(full.weight.detach(), 1, tp_size, tp_rank))
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        _mark(self.weight, 1, 1)

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


def _mark(p: nn.Parameter, dim: int, parts: int) -> None:
    p.tp_shard = (dim, parts)  # how to rebuild the full tensor; absent on replicated params


class TPCausalSelfAttention(nn.Module):
    """Attention over this rank's heads only: n_head / tp of them."""

    def __init__(self, attn, group, tp_size: int, tp_rank: int):
        super().__init__()
        self.n_head = attn.n_head // tp_size
        self.dropout = attn.dropout
        self.qkv = ColumnParallelLinear(attn.qkv, group, tp_size, tp_rank, parts=3)
        self.proj = RowParallelLinear(attn.proj, group, tp_size, tp_rank)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        local = q.shape[-1]
        q, k, v = (t.view(B, T, self.n_head, local // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, local))


def parallelize_gpt(model, group, tp_size: int, tp_rank: int):
    """Replace each block's attention and MLP linears by their tp slices, in place."""
    if tp_size == 1:
        return model
    for block in model.blocks:
        block.attn = TPCausalSelfAttention(block.attn, group, tp_size, tp_rank)
        block.fc = ColumnParallelLinear(block.fc, group, tp_size, tp_rank)
        block.fc_proj = RowParallelLinear(block.fc_proj, group, tp_size, tp_rank)
    return model


# ------------------------------------------- layout-independent state dicts


def _gather(t: torch.Tensor, spec, group, tp_size: int) -> torch.Tensor:
    shards = [torch.empty_like(t) for _ in range(tp_size)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return unshard(shards, spec[0], spec[1])


def full_state_dict(model, group=None, tp_size: int = 1) -> dict:
    """The unsplit model's state dict (a collective over the tp group when tp > 1)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, t in model.state_dict().items():
        spec = getattr(params.get(name), "tp_shard", None)
        out[name] = _gather(t, spec, group, tp_size) if spec and tp_size > 1 else t.clone()
    return out


def load_full_state_dict(model, state: dict, tp_size: int = 1, tp_rank: int = 0) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    local = {}
    for name, t in state.items():
        spec = getattr(params.get(name), "tp_shard", None)
        local[name] = shard(t, spec[0], tp_size, tp_rank, spec[1]) if spec and tp_size > 1 else t
    model.load_state_dict(local)


def full_optimizer_state(opt, model, group=None, tp_size: int = 1) -> dict:
    """The optimizer's state dict with per-parameter tensors made whole (collective if tp > 1)."""
    sd = opt.state_dict()
    if tp_size == 1:
        return sd
    specs = param_specs(opt)
    for idx, st in sd["state"].items():
        spec = specs[idx]
        if spec:
            sd["state"][idx] = {k: (_gather(v, spec, group, tp_size) if _like_param(v) else v)
                                for k, v in st.items()}
    return sd


def load_full_optimizer_state(opt, sd: dict, tp_size: int = 1, tp_rank: int = 0) -> None:
    if tp_size > 1:
        specs = param_specs(opt)
        for idx, st in sd["state"].items():
            spec = specs[idx]
            if spec:
                sd["state"][idx] = {k: (shard(v, spec[0], tp_size, tp_rank, spec[1])
                                        if _like_param(v) else v) for k, v in st.items()}
    opt.load_state_dict(sd)


def param_specs(opt) -> dict[int, tuple | None]:
    """Optimizer state index -> the parameter's tp_shard spec (torch numbers params in group order;
    `opt` keeps minddp.optim's protocol: original_params() in that order)."""
    return {i: getattr(p, "tp_shard", None) for i, p in enumerate(opt.original_params())}


def _like_param(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0  # exp_avg etc.; not the scalar 'step'


def grad_norm(params, group=None, tp_size: int = 1) -> torch.Tensor:
    """Global L2 norm of the gradients of the whole (unsplit) model (minddp.parallel.gradnorm): sharded
    gradients' squares are summed over the tp group, replicated ones counted once. No host sync."""
    return gradnorm.grad_norm(**_norm_args(params, group, tp_size))


def clip_grad_norm_(params, max_norm: float, group=None, tp_size: int = 1) -> torch.Tensor:
    """Global-norm clipping over the whole (unsplit) model; returns the norm before clipping."""
    return gradnorm.clip_grad_norm_(max_norm=max_norm, **_norm_args(params, group, tp_size))


def _norm_args(params, group, tp_size: int) -> dict:
    params = [p for p in params if p.grad is not None]
    tp = group if tp_size > 1 else None
    return {"grads": [p.grad for p in params], "tp_group": tp,
            "tp_sharded": [tp is not None and bool(getattr(p, "tp_shard", None)) for p in params]}
