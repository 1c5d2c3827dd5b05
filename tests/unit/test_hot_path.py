"""The engine's hot path without extra passes, bitwise against torch DDP on 3 gloo ranks: the
average's 1/n fused into the copy of each fresh gradient into its bucket (and every case where
gradients were not fresh: accumulated under no_sync, zeroed in place, unused), the overlapped
optimizer's per-bucket functional step, ZeRO-1's per-bucket step and gather; and how a bucket's
communication is timed per backend."""


import torch
from torch import nn

from minddp.engine.observer import clock_for


def test_bucket_steps_take_the_generic_path_where_the_fast_one_would_differ():
    from minddp.optim import BucketSteps

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))]
    opt = torch.optim.AdamW(params, lr=0.1)
    steps = BucketSteps(opt, [[[params[0]]], [[params[1]]]])
    for p in params:
        p.grad = torch.ones_like(p)
    assert steps._fast_lists(0) is None  # no state yet: the first step is optimizer.step()'s
    steps.step(0)
    steps.step(1)
    assert steps._fast_lists(0) is not None
    params[1].grad = None  # a parameter without a gradient: optimizer.step() skips it
    before = params[1].detach().clone()
    steps.step(1)
    assert torch.equal(params[1].detach(), before)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append(1))
    assert steps._fast_lists(0) is None  # a step hook: optimizer.step() runs it
    steps.step(0)
    assert calls == [1]
    assert BucketSteps(torch.optim.SGD(params, lr=0.1), [[params]])._fast_lists(0) is None


def test_gloo_is_timed_on_the_host_clock_even_with_cuda_tensors():
    assert clock_for("cuda", "nccl") == "cuda-events"
    assert clock_for("cuda", "cpu:gloo,cuda:nccl") == "cuda-events"
    assert clock_for("cuda", "gloo") == "host"  # its futures carry no CUDA event
    assert clock_for("cpu", "gloo") == "host"
