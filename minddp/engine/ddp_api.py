"""What DistributedDataParallel shows a script beside the step (minddp.engine.ddp is the step itself).

The constructor takes torch DDP's arguments in torch 2.13's order (`device_ids`, `output_device`,
`dim`, `broadcast_buffers`, `init_sync`, `process_group`, `bucket_cap_mb`,
`find_unused_parameters`, ..., `device_mesh`, `skip_all_reduce_unused_params`,
`bucket_cap_mb_list`, `batched_grad_copy`, `forward_sync_buffers`), so `DDP(model,
device_ids=[local_rank])` from an existing script works unchanged; minddp's own options are
keyword-only after them. They are held once, frozen, in `options` (minddp.engine.options).
`bucket_cap_mb` means what it means in torch DDP: a bucket closes once it reaches the cap; `None`
(the default) is 25 MiB after a 1 MiB first bucket; `bucket_cap_mb_list` gives each bucket its
own cap. `strict_bucket_cap=True` is minddp's alternative: a bucket never exceeds the cap.
`batched_grad_copy` is a switch of torch's C++ reducer (one `_foreach_copy_` per bucket instead
of one copy per gradient); it is accepted and changes nothing here: each gradient is copied into
its bucket once, as it arrives, during backward.

Every attribute torch's constructor sets without a leading underscore is here with torch's value
for the same arguments (tests/dist/test_public_attributes.py compares them one by one):
`require_backward_grad_sync` (False: the next forward/backward accumulates locally, what
`no_sync()` toggles; nanoGPT and llm.c set it per micro-step), `require_forward_param_sync`,
`module`, `process_group`, `device`, `device_type`, `device_ids`, `output_device`, `dim`,
`parameters_to_ignore`, `find_unused_parameters`, `static_graph`, `forward_sync_buffers` (and its
deprecated name `broadcast_buffers`), `gradient_as_bucket_view`, `batched_grad_copy`,
`mixed_precision`, `skip_all_reduce_unused_params`, `bucket_bytes_cap`, `bucket_bytes_cap_list`,
`bucket_bytes_cap_default`, `broadcast_bucket_size`, `use_side_stream_for_tensor_copies`,
`is_multi_device_module`, `modules_buffers`, `named_module_buffers`; `reducer` and `logger` are
minddp's own objects in torch's roles. The private names public code calls: `_set_static_graph()`
(the Hugging Face Trainer's), `_has_rebuilt_buckets` (torch's ddp_zero_hook reads it),
`_get_ddp_logging_data()`, `_set_params_and_buffers_to_ignore_for_model`. Also `no_sync()`,
`join()`, `register_comm_hook()`; the wrapper pickles (`torch.save`, `copy.deepcopy`) as torch's
does (minddp.engine.pickling). minddp's own: `comm_stats`, `trace`, `bucket_assignment`, `layout`,
`grad_norm()`, `clip_grad_norm_()`, `on_reduced`, `on_rebuild`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import gradnorm
from . import checks, replicas
from .observer import CommStats

BROADCAST_BUCKET_SIZE = 250 * 1024 * 1024  # torch's init-sync chunk (minddp's broadcasts chunk by 25 MB)


def _option(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.options, name), doc=doc)


class Logger:
    """torch DDP's `logger` in the role minddp has for it: the last error DDP's own checks raised,
    which `_get_ddp_logging_data()` reports (torch's tests read it back)."""

    def __init__(self):
        self.error: str | None = None

    def set_error_and_log(self, message: str) -> None:
        self.error = message


class PublicAPI:
    """Mixed into DistributedDataParallel: read-outs and registrations that never run in the step."""

    # torch DDP's attributes, as given to the constructor (held once, in `options`)
    find_unused_parameters = _option("find_unused_parameters", "torch's: unused parameters are allowed.")
    gradient_as_bucket_view = _option("gradient_as_bucket_view", "torch's, as given (gradients are views).")
    batched_grad_copy = _option("batched_grad_copy", "torch's, as given (changes nothing here).")
    mixed_precision = _option("mixed_precision", "torch's _MixedPrecision, or None.")
    skip_all_reduce_unused_params = _option("skip_all_reduce_unused_params", "torch's, as given.")
    dim = _option("dim", "torch's, as given.")
    bucket_bytes_cap = _option("bucket_bytes_cap", "torch's: the bucket cap in bytes.")
    bucket_bytes_cap_list = _option("bucket_bytes_cap_list", "torch's: bucket_cap_mb_list in bytes.")
    bucket_bytes_cap_default = _option("bucket_bytes_cap_default", "torch's: no cap was given.")
    broadcast_bucket_size = property(lambda self: BROADCAST_BUCKET_SIZE, doc="torch's init-sync chunk size.")
    device_type = property(lambda self: self.device.type, doc="torch's: the parameters' device type.")
    is_multi_device_module = property(lambda self: len({p.device for p in self.params}) > 1,
                                      doc="torch's: the module spans devices (never, in minddp).")
    static_graph = property(lambda self: self.reducer.static_graph, doc="torch's: _set_static_graph() ran.")
    _has_rebuilt_buckets = property(lambda self: self.reducer.rebuilt,
                                    doc="torch's (ddp_zero_hook reads it): the buckets were rebuilt.")
    # minddp's own options
    reduce_op = _option("reduce_op", "avg or sum.")
    compress = _option("compress", "None, fp16 or bf16: what travels.")
    algorithm = _option("algorithm", "the all-reduce algorithm.")
    overlap = _option("overlap", "buckets launched during backward.")
    shard_optimizer = _option("shard_optimizer", "ZeRO-1's reduce-scattered buckets.")
    optimizer_overlap = _option("optimizer_overlap", "each bucket stepped once reduced.")
    bucket_cap_mb = _option("bucket_cap_mb", "the cap in MiB as given (None: torch's default).")
    strict_bucket_cap = _option("strict_bucket_cap", "a bucket never exceeds the cap.")

    @property
    def bucket_cap_mb_list(self) -> list[float] | None:
        """torch 2.13's cap per bucket (MiB), as given."""
        caps = self.options.bucket_cap_mb_list
        return None if caps is None else list(caps)

    @property
    def device_ids(self) -> list[int] | None:
        """torch's: the module's device index in a list, None on the CPU or without device_ids."""
        ids = self.options.device_ids
        return None if ids is None else list(ids)

    @property
    def output_device(self) -> int | None:
        return self.options.output_device

    @property
    def use_side_stream_for_tensor_copies(self) -> bool:
        """torch's (PYTORCH_DDP_USE_SIDE_STREAM): minddp copies no inputs to the device."""
        return os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """torch's: the buffers each forward broadcasts, re-read each time (minddp.engine.replicas)."""
        return self.module_buffers

    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]:
        return replicas.named_synced_buffers(self.module, self.parameters_to_ignore)

    # the reducer's state, read by scripts, tools and tests under the names they always had
    layout = property(lambda self: self.reducer.layout, doc="Where every gradient lives (buckets.Layout).")
    reduction = property(lambda self: self.reducer.reduction, doc="How a bucket is reduced.")
    observer = property(lambda self: self.reducer.observer, doc="What is recorded about communication.")
    usage = property(lambda self: self.reducer.usage, doc="The unused-parameter flags.")
    rebuilt = property(lambda self: self.reducer.rebuilt, doc="The buckets were rebuilt (once).")

    @property
    def module_buffers(self) -> list[torch.Tensor]:
        """The buffers each forward broadcasts, re-read each time (minddp.engine.replicas)."""
        return list(replicas.named_synced_buffers(self.module, self.parameters_to_ignore).values())

    def on_reduced(self, fn) -> None:
        """Call fn(b) right after bucket b is reduced, in bucket order (later buckets in flight)."""
        self.reducer.on_reduced(fn)

    def on_rebuild(self, fn) -> None:
        """Call fn(layout) before `layout`'s buckets are rebuilt: views of its buffers must go."""
        self.reducer.on_rebuild(fn)

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of every gradient, read from the flat bucket buffers: one kernel per bucket
        instead of one per parameter, no host sync. Valid after a synchronised backward."""
        return gradnorm.grad_norm(self.layout.gradients())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the flat buffers; returns the norm before clipping."""
        checks.check_clip(self.optimizer_overlap)
        return gradnorm.clip_grad_norm_(self.layout.gradients(), max_norm)

    def remove_hooks(self) -> None:
        """Detach this wrapper from the module (also done when the wrapper is garbage-collected)."""
        self._finalizer()

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore) -> None:
        """torch DDP's way to leave parameters and buffers out, by fully qualified name: call it on
        the plain module before wrapping; they are neither reduced nor broadcast (torch's attributes)."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name in params_and_buffers_to_ignore:
                t._ddp_ignored = True

    def _get_ddp_logging_data(self) -> dict:
        """torch DDP's logger read (many of torch's tests call it first): the fields that have a
        meaning in minddp, under torch's names and in torch's types (int flags, strings for lists).

        What the wrapper was built with: world_size, rank (in the group), backend_name, module_name,
        device_ids ("" on the CPU, else the module's device index), output_device (-1 on the CPU),
        is_multi_device_module (always 0: minddp wraps single-device modules), has_sync_bn,
        broadcast_buffers (forward_sync_buffers), bucket_cap_bytes (25 MiB by default),
        find_unused_parameters, static_graph (1, absent when off, as torch's), gradient_as_bucket_view
        (the argument as given; minddp's gradients are bucket views either way), dtypes (torch's names:
        "float", "double"), num_parameter_tensors, total_parameter_size_bytes (the trained parameters).
        What it does: iteration (the synchronised iterations before the current one: torch logs an
        iteration at the next forward), bucket_sizes (bytes per bucket, the current buckets),
        has_rebuilt_buckets and rebuilt_bucket_sizes (minddp rebuilds once, also with
        find_unused_parameters, where torch does not), comm_hook (the registered hook's qualified
        name; absent without one), join_uneven_inputs (1 inside join(), else absent; torch keeps 1 once
        join() ran), has_error and
        error (the last error DDP's own checks raised on this wrapper, e.g. register_comm_hook's:
        `logger.error`).
        Not given (no meaning here): the C++ reducer's timings, environment variables, nccl fields."""
        group, params = self.process_group, self.params
        device = params[0].device
        sizes = ", ".join(str(b.grad_nbytes) for b in self.layout.buckets)
        hook = getattr(self.reduction, "hook", None)  # a registered comm hook (reductions.CommHook)
        data = {
            "world_size": self.world_size, "rank": dist.get_rank(group),
            "backend_name": str(dist.get_backend(group)), "module_name": type(self.module).__name__,
            "device_ids": "" if device.type == "cpu" else str(device.index),
            "output_device": -1 if device.type == "cpu" else device.index,
            "is_multi_device_module": int(len({p.device for p in params}) > 1),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())),
            "broadcast_buffers": int(self.forward_sync_buffers),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "dtypes": ", ".join(sorted({_TORCH_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "iteration": max(self.reducer.iterations - 1, 0),  # torch logs one at the next forward
            "bucket_sizes": sizes,
            "has_rebuilt_buckets": int(self.rebuilt),
            "has_error": int(self.logger.error is not None),
        }
        if self.rebuilt:
            data["rebuilt_bucket_sizes"] = sizes
        if self.static_graph:  # torch's keys that appear only once set
            data["static_graph"] = 1
        if self.joined:
            data["join_uneven_inputs"] = 1
        if hook is not None:
            data["comm_hook"] = getattr(hook, "__qualname__", str(hook))
        if self.logger.error is not None:
            data["error"] = self.logger.error
        return data

    @property
    def joined(self) -> bool:
        """Inside `join()` (torch's logging data "join_uneven_inputs")."""
        return self.uneven is not None

    @contextmanager
    def logging_errors(self):
        """Raise as usual, and keep the text for _get_ddp_logging_data (torch's logger records the
        errors its checks raise; torch's tests read them back)."""
        try:
            yield
        except Exception as e:
            self.logger.set_error_and_log(str(e))
            raise

    @property
    def comm_stats(self) -> CommStats:
        """The last synchronised iteration's communication (see minddp.engine.observer)."""
        return self.observer.read()

    @property
    def trace(self) -> list | None:
        """Set to a list to record (event, bucket, time) tuples (minddp.train.metrics.steptrace)."""
        return self.observer.trace

    @trace.setter
    def trace(self, events: list | None) -> None:
        self.observer.trace = events

    @property
    def bucket_assignment(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self.names[i] for i in b.param_ids] for b in self.layout.buckets]

    @property
    def layout_version(self) -> int:
        return self.layout.version


# torch's logger names a dtype by its C++ type name (caffe2's TypeMeta)
_TORCH_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                      torch.bfloat16: "c10::BFloat16"}
