"""Tensor-parallel layers and GPT against their unsplit versions (gloo, 2 ranks = one tp group)."""


import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import minddp
from minddp.model.gpt import GPT, GPTConfig
from minddp.parallel import tensor_parallel as tp
from tests import launch


def _layers(rank, world_size):
    group = dist.group.WORLD
    torch.manual_seed(0)
    a, b = nn.Linear(8, 12), nn.Linear(12, 8)
    col = tp.ColumnParallelLinear(a, group, world_size, rank)
    row = tp.RowParallelLinear(b, group, world_size, rank)
    x = torch.randn(3, 5, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = row(torch.tanh(col(x)))
    y_ref = b(torch.tanh(a(x_ref)))
    assert_close(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert_close(x.grad, x_ref.grad)  # f's all-reduce makes the input gradient whole
    assert_close(col.weight.grad, tp.shard(a.weight.grad, 0, world_size, rank))
    assert_close(col.bias.grad, tp.shard(a.bias.grad, 0, world_size, rank))
    assert_close(row.weight.grad, tp.shard(b.weight.grad, 1, world_size, rank))
    assert_close(row.bias.grad, b.bias.grad)


def test_column_and_row_parallel_match_nn_linear():
    launch.ranks(_layers, 2)


def _gpt(rank, world_size):
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = tp.parallelize_gpt(copy.deepcopy(ref), dist.group.WORLD, world_size, rank)
    # the same initial weights as the unsplit model, sliced
    full = tp.full_state_dict(model, dist.group.WORLD, world_size)
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k], v), k
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss_of(m):
        logits = m(idx[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())

    loss, loss_ref = loss_of(model), loss_of(ref)
    assert_close(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    norm = tp.clip_grad_norm_(model.parameters(), 0.1, dist.group.WORLD, world_size)
    norm_ref = nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert_close(norm, norm_ref)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        spec = getattr(dict(model.named_parameters())[n], "tp_shard", None)
        got = grads[n]
        if spec:
            shards = [torch.empty_like(got) for _ in range(world_size)]
            dist.all_gather(shards, got.contiguous())
            got = tp.unshard(shards, *spec)
        assert_close(got, p.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")

    # optimizer state round trip through the layout-independent form
    opt = minddp.ReplicatedOptimizer(None, torch.optim.AdamW, model.parameters(), lr=1e-3)
    opt.step()
    sd = tp.full_optimizer_state(opt, model, dist.group.WORLD, world_size)
    qkv_index = [n for n, _ in model.named_parameters()].index("blocks.0.attn.qkv.weight")
    assert sd["state"][qkv_index]["exp_avg"].shape == (96, 32)  # whole
    opt2 = minddp.ReplicatedOptimizer(None, torch.optim.AdamW, model.parameters(), lr=1e-3)
    tp.load_full_optimizer_state(opt2, sd, world_size, rank)
    assert torch.equal(opt2.state_dict()["state"][qkv_index]["exp_avg"],
                       opt.state_dict()["state"][qkv_index]["exp_avg"])


def test_tensor_parallel_gpt_matches_unsplit_gpt():
    launch.ranks(_gpt, 2)
