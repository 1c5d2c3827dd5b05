"""What DistributedDataParallel shows a script beside the step (minddp.engine.ddp is the step itself).

The constructor takes torch DDP's arguments in torch 2.13's order (`device_ids`, `output_device`,
`dim`, `broadcast_buffers`, `init_sync`, `process_group`, `bucket_cap_mb`,
`find_unused_parameters`, ..., `device_mesh`, `skip_all_reduce_unused_params`,
`bucket_cap_mb_list`, `batched_grad_copy`, `forward_sync_buffers`), so `DDP(model,
device_ids=[local_rank])` from an existing script works unchanged; minddp's own options are
keyword-only after them. `bucket_cap_mb` means what it means in torch DDP: a bucket closes once
it reaches the cap; `None` (the default) is 25 MiB after a 1 MiB first bucket;
`bucket_cap_mb_list` gives each bucket its own cap. `strict_bucket_cap=True` is minddp's
alternative: a bucket never exceeds the cap. `batched_grad_copy` is a switch of torch's C++
reducer (one `_foreach_copy_` per bucket instead of one copy per gradient); it is accepted and
changes nothing here: each gradient is copied into its bucket once, as it arrives, during backward.

torch DDP's attributes a script may set or read: `require_backward_grad_sync` (False: the next
forward/backward accumulates locally, what `no_sync()` toggles; nanoGPT and llm.c set it per
micro-step), `require_forward_param_sync`, `module`, `process_group`, `bucket_cap_mb`,
`find_unused_parameters`, `forward_sync_buffers` (and its deprecated name `broadcast_buffers`),
`no_sync()`, `join()`, `register_comm_hook()`, the static method
`_set_params_and_buffers_to_ignore_for_model`; the wrapper pickles (`torch.save`,
`copy.deepcopy`) as torch's does (minddp.engine.pickling). minddp's own: `comm_stats`, `trace`,
`bucket_assignment`, `layout`, `grad_norm()`, `clip_grad_norm_()`, `on_reduced`, `on_rebuild`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import gradnorm
from . import checks, pickling
from .observer import CommStats


class PublicAPI:
    """Mixed into DistributedDataParallel: read-outs and registrations that never run in the step."""

    def on_reduced(self, fn) -> None:
        """Call fn(b) right after bucket b is reduced, in bucket order (later buckets in flight)."""
        self.reducer.reduced_callbacks.append(fn)

    def on_rebuild(self, fn) -> None:
        """Call fn(layout) before `layout`'s buckets are rebuilt: views of its buffers must go."""
        self.reducer.rebuild_callbacks.append(fn)

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

    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's deprecated name of `forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

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
        error (the last error DDP's own checks raised on this wrapper, e.g. register_comm_hook's).
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
            "bucket_cap_bytes": int((25 if self.bucket_cap_mb is None else self.bucket_cap_mb) * 1024 * 1024),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "dtypes": ", ".join(sorted({_TORCH_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "iteration": max(self.observer.iterations - 1, 0),  # torch logs one at the next forward
            "bucket_sizes": sizes,
            "has_rebuilt_buckets": int(self.rebuilt),
            "has_error": int(self.logged_error is not None),
        }
        if self.rebuilt:
            data["rebuilt_bucket_sizes"] = sizes
        if self.static_graph:  # torch's keys that appear only once set
            data["static_graph"] = 1
        if self.joined:
            data["join_uneven_inputs"] = 1
        if hook is not None:
            data["comm_hook"] = getattr(hook, "__qualname__", str(hook))
        if self.logged_error is not None:
            data["error"] = self.logged_error
        return data

    logged_error: str | None = None  # what _get_ddp_logging_data reports as "error"

    @property
    def joined(self) -> bool:
        """Inside `join()` (torch's logging data "join_uneven_inputs")."""
        return self.reducer.uneven is not None

    @contextmanager
    def logging_errors(self):
        """Raise as usual, and keep the text for _get_ddp_logging_data (torch's logger records the
        errors its checks raise; torch's tests read them back)."""
        try:
            yield
        except Exception as e:
            self.logged_error = str(e)
            raise

    def __getstate__(self):
        return pickling.getstate(self)

    def __setstate__(self, state) -> None:
        pickling.setstate(self, state)

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

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        """torch 2.13's attribute: bucket_cap_mb_list in bytes, [] without one."""
        return [int(cap * 1024 * 1024) for cap in self.bucket_cap_mb_list or []]


# torch's logger names a dtype by its C++ type name (caffe2's TypeMeta)
_TORCH_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                      torch.bfloat16: "c10::BFloat16"}
