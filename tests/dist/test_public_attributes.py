"""What scripts read on torch's wrapper, read on minddp's: every attribute torch DDP's constructor
sets without a leading underscore (found on a live torch wrapper, so the next torch release's
additions fail here, not in a user's script) exists on minddp's wrapper with torch's value for the
same arguments; and the private names public code calls behave as torch's: `_set_static_graph()`
(the Hugging Face Trainer calls it under gradient checkpointing) and `_has_rebuilt_buckets`
(torch's ddp_zero_hook reads it)."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

import minddp
from tests import launch
from tests.models import WithBN, batch, shard

TORCH_DDP = nn.parallel.DistributedDataParallel
# minddp's own objects in the role torch's have: they exist, of minddp's kind
OWN_KIND = {"reducer", "logger"}
MP = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)

CASES = {
    "defaults": {},
    "caps and flags": dict(bucket_cap_mb=5, find_unused_parameters=True, gradient_as_bucket_view=True,
                           broadcast_buffers=False, dim=1, batched_grad_copy=True),
    "cap list, static graph": dict(bucket_cap_mb_list=[1, 4], static_graph=True,
                                   skip_all_reduce_unused_params=True, forward_sync_buffers=False),
    "ignored names": dict(ignore=["fc.bias", "bn.running_mean"]),
    "mixed precision": dict(mixed_precision=MP),
}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, nn.Module):
        return type(a) is type(b)
    return type(a) is type(b) and a == b


def _compare(rank, world_size, case):
    args = dict(CASES[case])
    ignore = args.pop("ignore", None)
    torch.manual_seed(0)
    base = WithBN()
    if ignore:
        TORCH_DDP._set_params_and_buffers_to_ignore_for_model(base, ignore)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, ours = TORCH_DDP(copy.deepcopy(base), **args), minddp.DDP(copy.deepcopy(base), **args)
    public = sorted(k for k in vars(theirs) if not k.startswith("_"))
    missing = [k for k in public if not hasattr(ours, k)]
    differ = [f"{k}: torch {getattr(theirs, k)!r} minddp {getattr(ours, k)!r}" for k in public
              if k not in missing and k not in OWN_KIND and not _same(_view(theirs, k), _view(ours, k))]
    kept = {n: str(b.dtype) for n, b in ours.named_module_buffers.items() if not b.is_floating_point()}
    return public, missing, differ, [type(getattr(ours, k)).__module__ for k in OWN_KIND], kept


def _view(model, name):
    """The attribute, but for one documented difference: under mixed_precision torch's code casts
    integer buffers too (BatchNorm's num_batches_tracked to bfloat16, a counter that stops at 256);
    minddp casts the floating ones, the rule torch's _MixedPrecision states."""
    value = getattr(model, name)
    if model.mixed_precision is None or name not in ("modules_buffers", "named_module_buffers"):
        return value
    if isinstance(value, dict):
        return {n: b for n, b in value.items() if not n.endswith("num_batches_tracked")}
    return [b for b in value if b.numel() > 1]  # (the counter is the one scalar buffer here)


@pytest.mark.parametrize("case", CASES)
def test_every_public_attribute_of_torchs_wrapper_is_on_minddps_with_torchs_value(case):
    for public, missing, differ, own, kept in launch.ranks(_compare, 2, case):
        assert {"parameters_to_ignore", "bucket_bytes_cap", "device_ids", "static_graph"} <= set(public)
        assert not missing, f"torch DDP sets {missing}; minddp's wrapper has none"
        assert not differ, differ
        assert all(m.startswith("minddp.engine") for m in own), own
        assert kept == {"bn.num_batches_tracked": "torch.int64"}  # an integer buffer is never cast


def _static_graph_later(rank, world_size):
    """The Hugging Face Trainer's order: wrap, then `_set_static_graph()`, then train; the same
    again afterwards (a warning), and once an iteration ran (torch's error, logged)."""
    torch.manual_seed(0)
    base, out = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), {}
    for name, wrap in (("torch", TORCH_DDP), ("minddp", minddp.DDP)):
        model = wrap(copy.deepcopy(base))
        before = model.static_graph
        model._set_static_graph()
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            model._set_static_graph()
        rebuilt, versions = [model._has_rebuilt_buckets], []
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(step, world_size)
            opt.zero_grad()
            nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
            opt.step()
            rebuilt.append(model._has_rebuilt_buckets)
            versions.append(getattr(model, "layout_version", None))
        late = wrap(copy.deepcopy(base))
        late(shard(batch(0, world_size)[0], rank)).sum().backward()
        try:
            late._set_static_graph()
            error = None
        except RuntimeError as e:
            error = str(e)
        out[name] = dict(before=before, after=model.static_graph, warned=[str(w.message) for w in again],
                         rebuilt=rebuilt, versions=versions,
                         params=[p.detach().clone() for p in model.parameters()],
                         error="should be called before training loop starts" in (error or ""),
                         logged="should be called before training loop starts"
                         in late._get_ddp_logging_data().get("error", ""))
    return out


def test_set_static_graph_and_has_rebuilt_buckets_behave_as_torchs():
    for out in launch.ranks(_static_graph_later, 2):
        torch_, ours = out["torch"], out["minddp"]
        assert (ours["before"], ours["after"]) == (torch_["before"], torch_["after"]) == (False, True)
        again = ["You've set static_graph to be True, no need to set it again."]
        assert ours["warned"] == torch_["warned"] == again
        assert ours["error"] and torch_["error"] and ours["logged"] and torch_["logged"]
        # False before training, True once the buckets are rebuilt and final (what ddp_zero_hook waits
        # for): torch's static graph rebuilds at its third forward, minddp at its first backward's end
        assert torch_["rebuilt"][0] is ours["rebuilt"][0] is False
        assert torch_["rebuilt"][-1] is ours["rebuilt"][-1] is True
        final = [v for v, r in zip(ours["versions"], ours["rebuilt"][1:]) if r]
        assert len(set(final)) == 1, ours["versions"]  # no rebuild after it reads True
        for a, b in zip(torch_["params"], ours["params"]):
            assert torch.equal(a, b)
