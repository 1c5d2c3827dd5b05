"""What DistributedDataParallel checks before it builds anything, each error naming the fix:
its arguments (torch DDP's, in torch's meaning and with torch 2.13's warnings, and minddp's
own), that every rank holds the same model (or the broadcasts that follow would hang). Also the
usage errors the flags raise (minddp.engine.usage). Who owns a module's hooks is
minddp.engine.hooks'."""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.distributed as dist
from torch import nn

from .. import _compat
from .comm_hooks import GradBucket
from .communicator import ALGORITHMS


def check_used_here(names: list[str], used: list[bool]) -> None:
    here = [names[i] for i, u in enumerate(used) if not u]
    if here:
        raise RuntimeError(
            f"minddp: {len(here)} parameter(s) received no gradient on this rank: {here}. With "
            "shard_optimizer every parameter must take part in the loss on every rank (or be frozen "
            "with requires_grad_(False)).")


def check_same_model(module: nn.Module, trainable: list[str], group, ignored=frozenset()) -> None:
    """Every rank must hold the same tensors, or the broadcasts that follow would hang (the
    ignored ones, `_set_params_and_buffers_to_ignore_for_model`, never travel)."""
    mine = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()
            if n not in ignored]
    mine += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()
             if n not in ignored]
    mine += [("requires_grad", tuple(trainable))]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    ref = everyone[0]
    for r, sig in zip(ranks[1:], everyone[1:]):
        if sig == ref:
            continue
        for k in range(max(len(ref), len(sig))):
            a = ref[k] if k < len(ref) else "nothing"
            b = sig[k] if k < len(sig) else "nothing"
            if a != b:
                raise RuntimeError(
                    "minddp.DistributedDataParallel: the model differs across ranks. "
                    f"Entry #{k}: rank {ranks[0]} has {_describe(a)} but rank {r} has "
                    f"{_describe(b)}. Build the same model (same config, same code path) "
                    "on every rank before wrapping it.")


def normalise_compress(compress):
    """None for no compression, whichever way it was written ("none", "None", "" from a CLI)."""
    return None if compress in ("none", "None", "") else compress


def option_problems(reduce_op, compress, bucket_cap_mb, shard_optimizer, algorithm,
                    find_unused_parameters, optimizer_overlap, config: bool = False):
    """The rules on DDP's own options, one line each naming the fix: the engine raises the first
    (keyword names), the trainer's config reports them all (ddp.<key> names, `config=True`)."""
    n = (lambda k: f"ddp.{k}") if config else (lambda k: k)  # noqa: E731
    on = (lambda k: f"ddp.{k}=true") if config else (lambda k: f"{k}=True")  # noqa: E731
    null, compress = ("null" if config else "None"), normalise_compress(compress)
    if reduce_op not in ("avg", "sum"):
        yield f"{n('reduce_op')} must be avg or sum, got {reduce_op!r}"
    if compress not in (None, "fp16", "bf16"):
        yield f"{n('compress')} must be {null}, fp16 or bf16, got {compress!r}"
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:  # NaN too
        yield f"{n('bucket_cap_mb')} must be positive (or {null} for torch's default), got {bucket_cap_mb}"
    if algorithm not in ALGORITHMS:
        yield f"{n('algorithm')} must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}"
    if shard_optimizer and compress is not None:
        yield (f"{on('shard_optimizer')} does not combine with {n('compress')}={compress}: the shards are "
               "reduce-scattered in the gradients' own dtype; drop one of the two")
    if shard_optimizer and algorithm != "native":
        native = "native" if config else "'native'"
        yield (f"{on('shard_optimizer')} uses the backend's reduce-scatter; {n('algorithm')}={algorithm} "
               f"only implements all-reduce: use {n('algorithm')}={native}")
    if shard_optimizer and find_unused_parameters:
        yield (f"{on('shard_optimizer')} does not support {on('find_unused_parameters')}: freeze unused "
               "parameters with requires_grad_(False) instead")
    if shard_optimizer and optimizer_overlap:
        yield (f"{n('optimizer_overlap')} does not combine with {n('shard_optimizer')}: ZeRO-1 steps its "
               "shard after backward (ShardedOptimizer.step()); choose one of the two")
    if find_unused_parameters and optimizer_overlap:
        yield (f"{n('optimizer_overlap')} does not combine with {on('find_unused_parameters')}: which "
               "parameters some rank used is known only from the last bucket, after the first buckets "
               "were stepped; freeze unused parameters with requires_grad_(False)")


def check_arguments(reduce_op, compress, bucket_cap_mb, shard_optimizer, algorithm,
                    find_unused_parameters, optimizer_overlap=False, bucket_cap_mb_list=None) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "minddp.DistributedDataParallel needs an initialised process group: "
            "call minddp.init_distributed() (or torch.distributed.init_process_group) first"
        )
    for problem in option_problems(reduce_op, compress, bucket_cap_mb, shard_optimizer, algorithm,
                                   find_unused_parameters, optimizer_overlap):
        raise ValueError(problem)
    if bucket_cap_mb_list is not None and not all(c > 0 for c in bucket_cap_mb_list):  # NaN too
        raise ValueError(f"bucket_cap_mb_list must hold positive sizes in MiB, "
                         f"got {list(bucket_cap_mb_list)}")


BOTH_BUFFER_FLAGS = ("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                     "`broadcast_buffers` is deprecated and its value is ignored when "
                     "`forward_sync_buffers` is provided.")
BROADCAST_BUFFERS_DEPRECATED = (
    "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
    "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init. If you rely "
    "on buffers NOT being synced at init (e.g. rank-local buffers), keep using `broadcast_buffers=False` "
    "until `init_sync_buffers` is available.")
CHECK_REDUCTION_DEPRECATED = ("The `check_reduction` argument in `DistributedDataParallel` module is "
                              "deprecated. Please avoid using it.")


def buffer_sync(broadcast_buffers, forward_sync_buffers, check_reduction) -> tuple[bool, bool]:
    """torch 2.13's rule: (sync buffers at each forward, include them in the init sync), with its
    FutureWarnings pointing at the constructor's caller. `broadcast_buffers=False` (deprecated)
    leaves buffers out of both; `forward_sync_buffers=False` only out of the forwards'."""
    if broadcast_buffers is not None:
        message = BOTH_BUFFER_FLAGS if forward_sync_buffers is not None else BROADCAST_BUFFERS_DEPRECATED
        warnings.warn(message, FutureWarning, stacklevel=3)
    if check_reduction:
        warnings.warn(CHECK_REDUCTION_DEPRECATED, FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    on = True if broadcast_buffers is None else broadcast_buffers
    return on, on


def ignored_names(module: nn.Module) -> set[str]:
    """What `_set_params_and_buffers_to_ignore_for_model` left out (torch's attribute)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def check_trainable(names: list[str]) -> None:
    if not names:  # torch's error, word for word
        raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any parameter "
                           "that requires a gradient.")


def check_comm_hook(hook) -> None:
    """torch's `_check_comm_hook`, at registration: callable, with torch's annotations if any
    (minddp's own GradBucket and a bare Future too: minddp's built-in hooks use them)."""
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    try:
        sig = inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError):  # annotations that do not evaluate: torch cannot check them
        return
    bucket = sig.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    futures = (inspect.Signature.empty, torch.futures.Future[torch.Tensor], torch.futures.Future)
    if sig.return_annotation not in futures:
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor].")


def check_clip(optimizer_overlap: bool) -> None:
    if optimizer_overlap:
        raise RuntimeError(
            "minddp: clip_grad_norm_ does not combine with optimizer_overlap=True: each bucket's parameters "
            "were already stepped as soon as it was reduced, before the global gradient norm (which needs "
            "every bucket) was known. Use optimizer_overlap=False to clip; grad_norm() still reads the norm.")


def torch_arguments(module, device_ids, process_group, device_mesh,
                    delay_all_reduce_named_params, param_to_hook_all_reduce):
    """torch DDP's constructor arguments: the ones that matter for a single-device module are
    honoured or checked as torch does; the features minddp lacks are refused by name.
    (`output_device`, `dim`, `check_reduction` and `gradient_as_bucket_view` change nothing here:
    gradients are always bucket views; `static_graph` is the reducer's, minddp.engine.reducer;
    `mixed_precision` minddp.engine.mixed_precision's.)
    Returns the process group to use: the mesh's, the one given, or the default group."""
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):  # torch's text
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the "
                         "same time.")
    if delay_all_reduce_named_params is not None:
        raise NotImplementedError(
            "minddp.DistributedDataParallel does not implement torch DDP's delay_all_reduce_named_params / "
            "param_to_hook_all_reduce (torch starts that all-reduce from a tensor hook and never waits for "
            "it): leave those parameters out with _set_params_and_buffers_to_ignore_for_model and reduce "
            "them yourself, or use torch DDP")
    if device_mesh is not None:  # torch's checks and texts
        if process_group is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        process_group = device_mesh.get_group(mesh_dim=0)
    if not device_ids:  # None, or torch's old spelling []
        return process_group if process_group is not None else dist.group.WORLD
    ignored = ignored_names(module)  # never touched: they may be no plain tensor (a ShardedTensor)
    devices = {p.device for n, p in module.named_parameters() if n not in ignored}
    if len(devices) != 1 or next(iter(devices)).type == "cpu":
        raise ValueError(f"device_ids={device_ids} only works with a single-device GPU module (torch DDP's "
                         f"rule); this module's parameters are on {sorted(map(str, devices))}: pass "
                         "device_ids=None")
    want = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else None
    index = device_ids[0] if isinstance(device_ids[0], int) else want.index
    if len(device_ids) != 1 or next(iter(devices)).index != index:
        raise ValueError(f"device_ids={device_ids}: the module is on {next(iter(devices))}; give "
                         "exactly the one device it lives on (move it with .to(device) first)")
    return process_group if process_group is not None else dist.group.WORLD


def torch_devices(module, device_ids, output_device) -> dict:
    """torch DDP's `device_ids` and `output_device` attributes (checked by `torch_arguments`):
    None for a CPU module or without device_ids, else the device indices (torch's
    `_get_device_index`); `output_device` defaults to the first of `device_ids`."""
    if not device_ids:
        return {"device_ids": None, "output_device": None}
    index = lambda d: d if isinstance(d, int) else torch.device(d).index  # noqa: E731
    out = device_ids[0] if output_device is None else output_device
    return {"device_ids": tuple(index(d) for d in device_ids), "output_device": index(out)}


def check_not_wrapped(module: nn.Module, wrapper: type) -> None:
    if isinstance(module, (wrapper, _compat.TORCH_DDP)):
        raise TypeError(f"minddp.DistributedDataParallel: the module is already a {type(module).__name__}; "
                        "wrap the plain model once (pass `ddp.module` to wrap it anew)")


def _describe(entry) -> str:
    if entry == "nothing":
        return "no further tensor"
    if entry[0] == "requires_grad":
        return f"trainable parameters {list(entry[1])}"
    kind, name, shape, dtype = entry
    return f"{kind} {name!r} of shape {list(shape)} and dtype {dtype}"


def unused_parameters_error(names: list[str], flags: list[bool], used: list[bool]) -> None:
    """Raised on every rank when the usage flags say some rank left parameters unused (read at
    the forward after that backward, as torch DDP raises)."""
    unused = [n for n, f in zip(names, flags) if f]
    here = [names[i] for i, u in enumerate(used) if not u]
    raise RuntimeError(
        f"minddp: {len(unused)} parameter(s) received no gradient on at least one rank "
        f"in this iteration: {unused} (on this rank: {here}). Every rank stopped here. "
        "Fix: make these parameters take part in the loss on every rank, freeze them "
        "with requires_grad_(False) if they are not trained, or wrap the model with "
        "find_unused_parameters=True.")
