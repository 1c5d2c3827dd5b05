"""torch-style communication hooks: `GradBucket` and the built-in hooks.

A hook has torch DDP's shape, `hook(state, bucket) -> Future`: it gets a
`GradBucket` and returns a future whose value is the reduced bucket, as a tensor
or a one-element list as torch's collectives give (any dtype; the engine copies
it back into the bucket's flat buffer). Register one with
`DistributedDataParallel.register_comm_hook(state, hook)`.

`bucket.all_reduce(t)` reduces with the engine's own group, averaging rule and
algorithm (minddp.engine.communicator), so a hook only decides *what* travels. The
16-bit hooks below run on gloo too (torch's own bf16 hook refuses to run on CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import _compat
from .communicator import Communicator


@dataclass
class GradBucket:
    """What a hook sees of one bucket (mirrors torch's `dist.GradBucket`)."""

    _index: int
    _buffer: torch.Tensor
    _params: list[torch.Tensor]
    _grads: list[torch.Tensor]
    _is_last: bool
    comm: Communicator  # the engine's group, averaging rule and algorithm

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer. The last bucket carries a few extra flag
        elements after the gradients; reduce the whole buffer."""
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def is_last(self) -> bool:
        return self._is_last

    @property
    def group(self):
        return self.comm.group

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """All-reduce `tensor` in place with the engine's group, op (avg or sum) and algorithm."""
        return self.comm(tensor).future


def returning_future(hook):
    """`hook` as the engine runs it: what it returns must be a future (torch's check and text,
    python_comm_hook.cpp), or the engine would fail later, deep inside its wait."""
    @functools.wraps(hook)  # the hook's own name: _get_ddp_logging_data()["comm_hook"]
    def run(state, bucket):
        fut = hook(state, bucket)
        if not _compat.is_future(fut):
            kind = type(fut)
            raise RuntimeError("DDP communication hook's callback must return a torch.futures.Future "
                               f"object, but got {kind.__module__}.{kind.__qualname__}")
        return fut

    return run


def allreduce_hook(state, bucket: GradBucket) -> torch.futures.Future:
    """The default: reduce the bucket in its own dtype, in place."""
    return bucket.all_reduce(bucket.buffer())


def compressed(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What travels in 16 bits: a copy in `dtype` (the engine copies the result back into the
    full-precision buffer, so stored gradients keep their own dtype), or the buffer itself."""
    return buffer if buffer.dtype == dtype else buffer.to(dtype)


def _compress_hook(dtype: torch.dtype):
    def hook(state, bucket: GradBucket) -> torch.futures.Future:
        return bucket.all_reduce(compressed(bucket.buffer(), dtype))

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

BUILTIN_HOOKS = {None: allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}
