"""Every private torch call minddp makes, in one place, each with why it is needed, and the
differences between the torch releases minddp supports (TORCH_FLOOR and later).

torch has no public API for these; if one moves in a later release, this file is
the only one to change.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed._shard._utils import narrow_tensor_by_index  # noqa: F401  (checkpoint.sharded's)
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint.planner_helpers import _create_chunk_from_tensor, _create_write_items

# DCP's helpers a storage writer and a planner of minddp's own build on (minddp.train.checkpoint.sharded):
# a writer's per-file transforms, one tensor's chunk and write items
StorageWriterTransforms = _StorageWriterTransforms
create_chunk_from_tensor = _create_chunk_from_tensor
create_write_items = _create_write_items

# The oldest torch minddp runs on: GPU nodes bring their own CUDA build (e.g. 2.11 with CUDA 13).
# pyproject.toml pins 2.13.0 exactly only so a CPU machine's `make install` gets the CPU wheel.
TORCH_FLOOR = "2.11"


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.11.0+cu130" -> (2, 11)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def torch_supported(version: str = torch.__version__) -> bool:
    return torch_release(version) >= torch_release(TORCH_FLOOR)


if not torch_supported():  # say it once, at import, rather than fail somewhere deep inside
    warnings.warn(f"minddp needs torch >= {TORCH_FLOOR}; this is torch {torch.__version__}", stacklevel=2)

# torch's DDP class, taken once, where dynamo takes it (torch._dynamo.convert_frame binds this name at
# its import). Never look it up by `torch.nn.parallel.DistributedDataParallel` at call time: a user who
# runs minddp inside a library that builds torch's DDP itself (HF Trainer) puts minddp's class under
# that name (minddp.as_torch_ddp), and minddp must still find torch's.
TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel

# torch's modules that bind `torch.nn.parallel.DistributedDataParallel` when they are imported (DCP's
# state_dict unwraps DDP with it, replicate and pipelining build one); tests/unit/test_as_torch_ddp.py
# reads torch's sources for more.
_BIND_TORCH_DDP_AT_IMPORT = ("torch.distributed.checkpoint.state_dict",
                             "torch.distributed._composable.replicate",
                             "torch.distributed.pipelining.stage",
                             "torch.distributed.algorithms._optimizer_overlap.optimizer_overlap")


def delay_all_reduce(ddp) -> None:
    """torch DDP's reducer entry that Lightning's manual optimization calls after the first
    backward of a static graph (its strategy's `post_backward`): that backward's reduction."""
    ddp.reducer._delay_all_reduce()


def import_torch_ddp_binders() -> None:
    """Import torch's modules that bind torch's DDP class by its public name at import, before
    minddp.as_torch_ddp swaps that name: one first imported inside the block (a checkpoint save)
    would keep minddp's class for the rest of the process."""
    import importlib

    for name in _BIND_TORCH_DDP_AT_IMPORT:
        importlib.import_module(name)


def optimizer_step_hooked(optimizer) -> bool:
    """Whether step hooks (the optimizer's own or global ones) are registered: a bucket's step then
    goes through `optimizer.step()`, which runs them (minddp.optim.BucketSteps)."""
    from torch.optim import optimizer as base

    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None) or
                getattr(optimizer, "_optimizer_step_post_hooks", None) or
                base._global_optimizer_pre_hooks or base._global_optimizer_post_hooks)


def queue_autograd_callback(fn) -> None:
    """Run `fn` once when the current backward pass ends: the engine waits for the last
    buckets there, so `loss.backward()` returns with reduced gradients (torch DDP's reducer
    does the same from C++)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[k].copy_(src[k]) for every k, in one call (torch's foreach kernels)."""
    torch._foreach_copy_(dst, src)


def version_of(t: torch.Tensor) -> int:
    """`t`'s version counter (shared by its views): each in-place write, autograd's accumulation
    into a `.grad` included, adds one."""
    return t._version


def foreach_zero_(tensors: list[torch.Tensor]) -> None:
    """t.zero_() for every t, in one call."""
    torch._foreach_zero_(tensors)


def flatten_dense_tensors(tensors):
    """One contiguous copy of many tensors: one broadcast instead of one per tensor."""
    return _flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat, like):
    return _unflatten_dense_tensors(flat, like)


def set_pg_timeout(seconds: float, group=None) -> None:
    """Shorten a process group's timeout after start-up: a slow first start-up (imports,
    W&B) needs a long timeout, a hang in training should fail fast."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def default_store():
    """The rendezvous key-value store: lets ranks exchange small messages (config errors,
    fingerprints) without a collective, so a rank that is stuck cannot block them."""
    return dist.distributed_c10d._get_default_store()


def all_gather_single(output, input, group=None, async_op=False):
    """torch 2.13's name for all_gather_into_tensor (deprecated there); the old name before."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """torch 2.13's name for reduce_scatter_tensor (deprecated there); the old name before."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def profiler_enabled() -> bool:
    """Whether a torch.profiler is recording: the engine names its bucket collectives with
    record_function only then, so they cost nothing otherwise."""
    return torch.autograd.profiler._is_profiler_enabled


def dump_flight_recorder(backend: str = "gloo") -> bytes:
    """torch's native flight recorder (TORCH_FR_BUFFER_SIZE) as the pickle its own analyser reads;
    torch exposes the dump only through c10d's private bindings. NCCL keeps its own recorder
    (CUDA-event timings, states): a process group on nccl dumps that one, `_dump_nccl_trace`
    (CUDA builds only); gloo's is `_dump_fr_trace`."""
    c10d = torch._C._distributed_c10d
    if "nccl" in backend and hasattr(c10d, "_dump_nccl_trace"):
        return c10d._dump_nccl_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    return c10d._dump_fr_trace(includeStackTraces=False)


def ddp_rebuilt_bucket_sizes(model) -> str:
    """torch DDP's bucket sizes after its rebuild, from its private logging data (the benchmark
    compares bucket counts with minddp's)."""
    return model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")


# dynamo's first split point: torch's C10D constant (1 MiB), which dynamo's DDPOptimizer always uses.
_DYNAMO_FIRST_BUCKET_BYTES = 1024 * 1024
_warned: set[str] = set()


class _DynamoDDPHandle:
    """What dynamo reads from the DDP module it finds: the bucket cap, in bytes."""

    def __init__(self, bucket_bytes_cap: int):
        self.bucket_bytes_cap = bucket_bytes_cap


@contextmanager
@torch._disable_dynamo(recursive=False)
def dynamo_sees_ddp(wrapper):
    """Run the wrapped module's call as torch DDP's forward runs it (`_inside_ddp_forward`): dynamo
    then compiles a whole-model graph with its DDPOptimizer, one subgraph per bucket of the wrapper's
    cap (torch's composable `replicate` sets the same handshake), so each bucket's gradients come
    out of their own backward node and go out while the rest of backward runs. Nested wrappers
    restore the outer one's handshake. Disabled for dynamo: under `torch.compile(minddp.DDP(m))` the
    module call inside is compiled as its own frame, with the handshake set. Below dynamo's fixed
    1 MiB first bucket torch DDP's compiled forward raises; minddp keeps the graph whole and says so."""
    cap = wrapper.bucket_bytes_cap  # torch's attribute: 25 MiB, the cap given, or the list's largest
    ddp = TORCH_DDP
    old = ddp._active_ddp_module
    if cap >= _DYNAMO_FIRST_BUCKET_BYTES:
        ddp._active_ddp_module = _DynamoDDPHandle(cap)
    elif _compiled(wrapper.module):
        warn_once("small-cap", "minddp: bucket_cap_mb below 1 keeps a compiled model one graph (dynamo's "
                  "first bucket is 1 MiB), so its communication waits for the end of backward; use "
                  "bucket_cap_mb >= 1 for buckets that go out during backward")
    try:
        yield
    finally:
        ddp._active_ddp_module = old


def _compiled(module) -> bool:
    """`module` is `torch.compile(m)`; without importing dynamo where nothing compiled anything."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def warn_once(key: str, message: str) -> None:
    """One warning per process, not one per step."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors in a module's output (nested tuples, lists, dicts, dataclasses torch's pytree
    knows), as torch DDP finds them after its forward."""
    if isinstance(output, torch.Tensor):  # the common case, without a tree walk
        return [output]
    import dataclasses

    from torch.utils._pytree import tree_leaves

    found = []
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):  # torch DDP walks them too
            found += output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found


def map_tensors(fn, tree):
    """`tree` (nested tuples, lists, dicts) with fn applied to each tensor in it (torch's pytree)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fn, tree)


def dynamo_one_graph():
    """A context under which torch.compile keeps a DDP-wrapped model one graph (dynamo's
    `optimize_ddp=False`): the benchmark's picture of compile without the split."""
    return torch._dynamo.config.patch(optimize_ddp=False)


def eager(fn):
    """`fn` always runs eagerly, never traced by dynamo (one graph break at its call), as torch
    DDP's own bookkeeping around the module runs under `torch.compile(ddp)`."""
    return torch._disable_dynamo(fn)


def in_backward() -> bool:
    """Is a backward pass running on this thread (a checkpoint's recomputation calls forward there)?"""
    return torch._C._current_graph_task_id() != -1


def is_future(value) -> bool:
    """A torch future of any origin (a collective's Work.get_future() is the C++ class itself)."""
    return isinstance(value, torch._C.Future)
