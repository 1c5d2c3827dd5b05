"""minddp.DDP as a drop-in for torch DDP in training loops we did not write (real gloo processes)."""


import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minddp
from minddp.model.gpt import GPT, GPTConfig
from tests import launch
from tests.models import MLP, assert_same_params, batch, params_of, shard

# whole training loops on real ranks (~22 s together): make test runs them, the inner loop does not
pytestmark = pytest.mark.slow


def _counting(model):
    """Count bucket reductions through a comm hook (every collective the engine issues)."""
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        return bucket.all_reduce(bucket.buffer())

    model.register_comm_hook(None, hook)
    return calls


def _nanogpt_accumulation(rank, world_size):
    """nanoGPT/llm.c: `model.require_backward_grad_sync = (micro == accum - 1)`, no no_sync()."""
    torch.manual_seed(0)
    base, accum = MLP(), 4
    ours = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=0.001)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
    calls = _counting(ours)
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            for micro in range(accum):
                model.require_backward_grad_sync = micro == accum - 1
                x, y = batch(step * accum + micro, world_size)
                loss = nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)) / accum
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert_same_params(params_of(ours), params_of(theirs))
    return len(calls), len(ours.bucket_assignment)


def test_require_backward_grad_sync_attribute_reduces_once_per_step():
    for n_calls, n_buckets in launch.ranks(_nanogpt_accumulation, 2):
        assert n_calls == 3 * n_buckets  # 3 optimizer steps, not 12 micro-steps


def _no_grad_forward_between(rank, world_size, mode):
    """forward, a teacher/EMA forward without grad, then backward: averaged as torch DDP does."""
    torch.manual_seed(0)
    base = MLP()
    results = {}
    for name, cls in (("ours", minddp.DDP), ("torch", nn.parallel.DistributedDataParallel)):
        model = cls(copy.deepcopy(base))
        x, y = batch(0, world_size)
        x2, _ = batch(1, world_size)
        out = model(shard(x, rank))
        if mode == "no_grad":
            with torch.no_grad():
                model(shard(x2, rank))
        elif mode == "inference_mode":
            with torch.inference_mode():
                model(shard(x2, rank))
        else:  # a grad-enabled forward outside sync: must not reset the pending backward either
            model.require_backward_grad_sync = False
            model(shard(x2, rank))
            model.require_backward_grad_sync = True
        nn.functional.mse_loss(out, shard(y, rank)).backward()
        results[name] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    assert_same_params(results["ours"], results["torch"])
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results["ours"])
    assert_same_params(gathered[0], gathered[1])  # the replicas agree


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_sync_attr"])
def test_forward_without_sync_leaves_pending_backward_alone(mode):
    launch.ranks(_no_grad_forward_between, 2, mode)


def _two_forwards_one_backward(rank, world_size):
    torch.manual_seed(0)
    base = MLP()
    grads = []
    for cls in (minddp.DDP, nn.parallel.DistributedDataParallel):
        model = cls(copy.deepcopy(base), bucket_cap_mb=0.001)
        calls = _counting(model) if cls is minddp.DDP else []
        x, y = batch(0, world_size)
        x2, y2 = batch(1, world_size)
        loss = nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)) + \
            nn.functional.mse_loss(model(shard(x2, rank)), shard(y2, rank))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
        if cls is minddp.DDP:
            assert len(calls) == len(model.bucket_assignment), calls  # one reduction
    assert_same_params(grads[0], grads[1])


def test_two_forwards_then_one_backward_of_the_sum_reduces_once():
    launch.ranks(_two_forwards_one_backward, 2)


def _bucket_counts(rank, world_size, cap_mb):
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=192, block_size=32, vocab_size=256))
    kw = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    ours = minddp.DDP(copy.deepcopy(base), **kw)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kw)
    for model in (ours, theirs):
        for _ in range(3):  # both rebuild their buckets after the first iteration
            model(torch.randint(0, 256, (2, 32))).float().pow(2).mean().backward()
    sizes = theirs._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    torch_sizes = [int(s) for s in sizes.split(",")]
    ours_sizes = [b.grad_nbytes for b in ours.layout.buckets]
    return ours_sizes, torch_sizes


@pytest.mark.parametrize("cap_mb", [None, 0.25, 1, 5])
def test_bucket_sizes_match_torch_ddp_after_rebuild(cap_mb):
    ours, theirs = launch.ranks(_bucket_counts, 2, cap_mb)[0]
    assert ours == theirs


def _compiled(rank, world_size):
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    eager = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    compiled = minddp.DDP(torch.compile(copy.deepcopy(base)), bucket_cap_mb=0.01)
    for model in (eager, compiled):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # Adam would amplify fusion rounding
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 64, (world_size * 2, 16), generator=g)[rank * 2:(rank + 1) * 2]
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
    a = {n: p for n, p in eager.module.named_parameters()}
    b = {n.removeprefix("_orig_mod."): p for n, p in compiled.module.named_parameters()}
    assert_same_params({n: p.detach() for n, p in a.items()}, {n: p.detach() for n, p in b.items()},
                       atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_wrapping_a_compiled_module_trains_like_eager():
    launch.ranks(_compiled, 2, timeout=240)


def _compressed_bytes(rank, world_size):
    torch.manual_seed(0)
    plain = minddp.DDP(MLP(), bucket_cap_mb=0.001)
    half = minddp.DDP(MLP(), bucket_cap_mb=0.001, compress="bf16")
    for model in (plain, half):
        x, y = batch(0, world_size)
        nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    return plain.comm_stats.bytes, half.comm_stats.bytes


def test_comm_stats_bytes_count_what_travels():
    plain, half = launch.ranks(_compressed_bytes, 2)[0]
    assert half * 2 == plain


def _wrap_twice(rank, world_size):
    model = MLP()
    first = minddp.DDP(model)
    second = minddp.DDP(model)  # as torch: the new wrapper takes the module over, the old one retires
    with pytest.raises(RuntimeError, match="wrapped again by a newer DistributedDataParallel"):
        first(torch.zeros(1, 8))
    with pytest.raises(TypeError, match="already a DistributedDataParallel"):
        minddp.DDP(second)
    del first, second
    gc.collect()
    # the dropped wrapper removed its hooks: a plain backward leaves local gradients
    x, y = batch(0, world_size)
    nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    every = [None] * world_size
    dist.all_gather_object(every, local)
    assert not torch.equal(every[0]["layers.0.weight"], every[1]["layers.0.weight"])
    second = minddp.DDP(model)  # and the module can be wrapped again
    second.remove_hooks()
    minddp.DDP(model)


def test_wrapping_again_retires_the_old_wrapper_and_dropped_wrapper_leaves_module_clean():
    launch.ranks(_wrap_twice, 2)


def _torch_signature(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    base = MLP()
    # torch's positional order: module, device_ids, output_device, dim, broadcast_buffers
    a = minddp.DDP(copy.deepcopy(base), None, None, 0, True, bucket_cap_mb=0.001)
    mesh = init_device_mesh("cpu", (world_size,))
    b = minddp.DDP(copy.deepcopy(base), device_mesh=mesh, gradient_as_bucket_view=True, static_graph=True)
    assert dist.get_process_group_ranks(b.process_group) == list(range(world_size))
    for model in (a, b):
        x, y = batch(0, world_size)
        nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    assert_same_params({n: p.grad for n, p in a.module.named_parameters()},
                       {n: p.grad for n, p in b.module.named_parameters()})
    with pytest.raises(ValueError, match="device_ids=\\[0\\] only works with a single-device GPU module"):
        minddp.DDP(MLP(), device_ids=[0])
    with pytest.raises(TypeError, match="mixed_precision must be torch's"):
        minddp.DDP(MLP(), mixed_precision=object())
    delayed = MLP()
    with pytest.raises(NotImplementedError, match="delay_all_reduce_named_params"):
        minddp.DDP(delayed, delay_all_reduce_named_params=list(delayed.named_parameters())[:1],
                   param_to_hook_all_reduce=next(delayed.parameters()))
    with pytest.raises(ValueError, match="need to be set at the same time"):
        minddp.DDP(MLP(), param_to_hook_all_reduce=next(delayed.parameters()))


def test_torch_ddp_constructor_arguments_are_accepted_in_torchs_order():
    launch.ranks(_torch_signature, 2)
