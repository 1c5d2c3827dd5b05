"""make bench-memory: what each configuration holds, the peak meter, the issue's criteria, and
one real run of separate torchrun jobs."""


import pytest
import torch

from minddp.perf import memory
from tests import launch

P = 100e6  # bytes of fp32 parameters


def _held(rank, world_size, config):
    """Bytes of distinct storage this rank holds after a step: parameters, gradients (beyond the
    bucket buffers they may view), bucket buffers, optimizer states; and P."""
    from minddp.perf.memory import state_bytes
    from minddp.tools.workload import GPT_PRESETS, build, lm_loss

    model, x = build(GPT_PRESETS["gpt-tiny"], torch.device("cpu"), batch=2)
    wrapped, opt = memory.configuration(config, model, torch.device("cpu"))
    lm_loss(wrapped, x).backward()
    opt.step()
    seen, held = set(), {"params": 0, "grads": 0, "buckets": 0}

    def count(kind, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held[kind] += storage.nbytes()

    for b in getattr(getattr(wrapped, "layout", None), "buckets", []):
        count("buckets", b.buffer)
    for p in model.parameters():
        count("params", p)
    for p in model.parameters():
        if p.grad is not None:
            count("grads", p.grad)
    P = sum(p.numel() * 4 for p in model.parameters())
    return {**held, "states": state_bytes(opt), "P": P}


@pytest.mark.parametrize("config", ["local", "minddp-ddp", "minddp-zero1", "minddp-overlap"])
def test_what_the_table_says_a_configuration_holds_is_what_it_holds(config):
    """HOLDS against the storages a real step leaves (2 ranks): parameters P, gradients P only
    where they are not bucket views, buckets P (padded by at most the world size and the usage
    flags), AdamW's states 2P or 2P/dp. ZeRO-1's flat parameter buffers count as its P."""

    held = launch.ranks(_held, 2, config)[0]
    P, (params, grads, buckets, sharded, _) = held["P"], memory.HOLDS[config]
    slack = 64 * 4  # padding to the world size and the usage flags after the last bucket
    assert held["params"] == pytest.approx(params * P, abs=slack), held
    assert held["grads"] == grads * P, held
    assert buckets * P <= held["buckets"] <= buckets * P + 8 * slack, held
    assert held["states"] == pytest.approx(2 * P / (2 if sharded else 1), rel=0.05), held
