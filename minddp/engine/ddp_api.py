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

import torch
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
