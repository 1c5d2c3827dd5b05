"""torch DDP's `mixed_precision` (`torch.nn.parallel.distributed._MixedPrecision`: `param_dtype`,
`reduce_dtype`, `buffer_dtype`), with torch's semantics:

- construction: the buffers are cast to `buffer_dtype` once, after the init sync (floating ones:
  the rule torch's `_MixedPrecision` states; torch's code also casts integer buffers);
- the forward sees every parameter (frozen ones too, ignored ones never) in `param_dtype`, and
  its floating inputs cast to `param_dtype`; a `.grad` accumulated earlier is cast down with
  them, so gradients accumulate in `param_dtype` (into buckets of that dtype), no_sync() too;
- the reduction: each bucket cast to `reduce_dtype` (default `param_dtype`), summed over ranks,
  then divided by the world size in `reduce_dtype` (torch's `_reducer_allreduce_and_upcast_hook`
  divides after the sum, not before);
- after the synchronised backward: every parameter back in its own (full) precision, unchanged
  by the forward, and `.grad` the reduced value in the parameters' dtype: what the optimizer
  and `state_dict()` see. Outside a forward and its backward the model is in full precision; a
  forward under no_grad (evaluation) leaves the parameters as it found them. As in torch, after
  a forward whose synchronised backward has not run yet (or a no_sync() micro-step), the
  parameters are still the `param_dtype` copies.

`param_dtype=None` casts nothing in the forward (torch's copies keep the parameters' dtype).
Like torch's, it owns how buckets are reduced: no comm hook, compression, ZeRO-1, optimizer
overlap or skip_all_reduce_unused_params beside it.
"""

from __future__ import annotations

import torch

from .. import _compat
from . import grads
from .communicator import Communicator, Started
from .reductions import Reduction

COMBINATIONS = (("compress", None), ("shard_optimizer", False), ("optimizer_overlap", False),
                ("skip_all_reduce_unused_params", False))


class MixedPrecision:
    """The casts around one wrapper's forward and backward."""

    @classmethod
    def of(cls, config, module, params: list[torch.Tensor], ignored, options) -> "MixedPrecision | None":
        """None without a config; refuses what does not combine with it."""
        if config is None:
            return None
        check(config, options)
        return cls(config, module, params, ignored)

    def __init__(self, config, module, params: list[torch.Tensor], ignored):
        self.param_dtype = config.param_dtype  # what the forward computes in (None: as they are)
        self.reduce_dtype = config.reduce_dtype or config.param_dtype  # None: the parameters' own
        self.buffer_dtype = config.buffer_dtype
        self.module, self.ignored = module, ignored
        self.params = params  # the trained ones: their gradients live in the layout's buckets
        self.cast = [p for n, p in module.named_parameters() if n not in ignored]  # frozen ones too
        self.full: list[torch.Tensor] | None = None  # their full-precision data, while cast

    def reduction(self, comm: Communicator, params: list[torch.Tensor]) -> Reduction:
        """How buckets are reduced (the reducer asks once)."""
        return MixedPrecisionAllReduce(comm, params, self.reduce_dtype)

    def cast_buffers(self) -> None:
        if self.buffer_dtype is None:
            return
        for name, b in self.module.named_buffers():
            if name not in self.ignored and b.is_floating_point():
                b.data = b.to(self.buffer_dtype)

    def to_compute(self, args, kwargs, layout) -> tuple[tuple, dict, bool]:
        """Before the forward: parameters and floating inputs in `param_dtype`. With grad enabled,
        a `.grad` held in full precision moves into its bucket view (param_dtype), where the
        backward accumulates. Returns (args, kwargs, whether to restore right after the forward:
        a no_grad forward that found the parameters in full precision)."""
        if self.param_dtype is None:
            return args, kwargs, False
        restore = False
        if self.full is None:
            grads = torch.is_grad_enabled()
            self.full = [p.data for p in self.cast]
            with torch.no_grad():
                for p in self.cast:
                    p.data = p.data.to(self.param_dtype)
            if grads:
                self._grads_down(layout)
            restore = not grads
        cast = lambda t: t.to(self.param_dtype) if t.is_floating_point() else t  # noqa: E731
        return _compat.map_tensors(cast, args), _compat.map_tensors(cast, kwargs), restore

    def _grads_down(self, layout) -> None:
        for i, p in enumerate(self.params):
            grads.move_into(p, layout.views[i])

    def to_full_precision(self, layout) -> None:
        """The parameters' own data back; with `layout` (after a synchronised backward) each
        `.grad` is the reduced gradient in the parameters' dtype (the layout's grad views)."""
        if self.full is None:
            return
        for p, data in zip(self.cast, self.full):
            p.data = data
        self.full = None
        if layout is not None:
            grads.to_grad_views(self.params, layout.grad_views)

    def refuse_comm_hook(self) -> None:
        raise RuntimeError("minddp: register_comm_hook does not combine with mixed_precision, whose own "
                           "reduction (cast to reduce_dtype, sum, divide) reduces the buckets (torch's "
                           "mixed_precision registers its hook the same way: a second one is refused)")


class MixedPrecisionAllReduce(Reduction):
    """torch's `_reducer_allreduce_and_upcast_hook`: the bucket (in param_dtype) cast to
    `reduce_dtype`, summed over ranks, divided by the world size in `reduce_dtype`; the result
    lands in the bucket's `grads` buffer (the parameters' dtype), which `.grad` then views. When
    `reduce_dtype` is the parameters' dtype the cast goes straight into `grads`, reduced in place."""

    def __init__(self, comm: Communicator, params: list[torch.Tensor], reduce_dtype: torch.dtype | None):
        super().__init__(comm, params)
        self.reduce_dtype = reduce_dtype

    def _reduce(self, b: int, buffer: torch.Tensor) -> Started:
        bucket = self.layout.buckets[b]
        dtype = self.reduce_dtype or bucket.grads.dtype
        if buffer is bucket.buffer and bucket.grads.dtype == dtype:
            bucket.grads.copy_(buffer)  # (the same tensor without a param_dtype)
            tensor = bucket.grads
        else:
            tensor = buffer if buffer.dtype == dtype else buffer.to(dtype)
        return self.comm(tensor, sum_only=True)  # a SUM: the average divides after it (finish)

    def finish(self, b: int, result) -> int:
        full = self.layout.buckets[b].grads
        if isinstance(result, list):  # torch's collectives give [tensor]
            result = result[0]
        if self.comm.average is not None:
            result.div_(self.comm.world)
        if result.data_ptr() != full.data_ptr():
            full.copy_(result)
        return result.numel() * result.element_size()

    def usage_flags(self, n: int) -> torch.Tensor | None:
        flags = self.layout.flags_bucket
        return None if flags is None else self.layout.buckets[flags].grads[-n:]


def check(config, options) -> None:
    """What mixed precision needs: floating dtypes, and the default way of reducing buckets."""
    names = ("param_dtype", "reduce_dtype", "buffer_dtype")
    if not all(hasattr(config, name) for name in names):
        raise TypeError(f"mixed_precision must be torch's torch.nn.parallel.distributed._MixedPrecision "
                        f"(param_dtype, reduce_dtype, buffer_dtype), got {type(config).__name__}")
    for name in names:
        dtype = getattr(config, name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"mixed_precision.{name} must be a floating torch dtype or None, got {dtype!r}")
    clash = [f"{k}={getattr(options, k)!r}" for k, default in COMBINATIONS if getattr(options, k) != default]
    if clash:
        raise ValueError(f"minddp: mixed_precision does not combine with {', '.join(clash)}: mixed precision "
                         "reduces each bucket its own way (cast to reduce_dtype, sum, divide, as torch's); "
                         "drop one of the two")
