"""Host <-> device copies that never block the host (what the step uses instead of `.item()`).

On CUDA a copy between a pageable host tensor and the device synchronises the host with the
stream; a copy from or into pinned memory with `non_blocking=True` does not. torch's caching
host allocator records the stream on each pinned block it hands out and does not reuse the
block before that copy has finished, so a fresh pinned tensor per copy is safe (torch DDP's
reducer copies its usage map the same way). On the CPU both are plain copies.

    dev = to_device([stop, rss], like=loss)  # host values onto the device, asynchronously
    copy_into(tail, flags)                   # ... or into an existing device tensor
    host = to_host(flags)                    # a device tensor into host memory, asynchronously
    ...                                      # later (the next forward):
    if host.landed(): host.tolist()          # read once the copy has finished: no wait
"""

from __future__ import annotations

import torch


def to_device(values, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (numbers) as a tensor on `like`'s device, without blocking the host."""
    pinned = like.is_cuda
    host = torch.tensor(values, dtype=dtype or like.dtype, pin_memory=pinned)
    return host.to(like.device, non_blocking=True) if pinned else host


def copy_into(dst: torch.Tensor, values) -> None:
    """dst[:] = values (numbers, or a host tensor), without blocking the host."""
    if isinstance(values, torch.Tensor):
        host = values.to(dst.dtype)
        host = host.pin_memory() if dst.is_cuda else host
    else:
        host = torch.tensor(values, dtype=dst.dtype, pin_memory=dst.is_cuda)
    dst.copy_(host, non_blocking=dst.is_cuda)


class HostCopy:
    """A device tensor's values on their way into host memory: `landed()` asks without
    waiting (an event query), `tolist()` reads them."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = tensor.detach().clone(), None

    def landed(self) -> bool:
        """Whether the copy has finished: never blocks the host."""
        if self.event is not None and self.event.query():
            self.event = None
        return self.event is None

    def tolist(self) -> list:
        """The values, once their copy has landed (waits for that copy, nothing later, if
        `landed()` was not True yet)."""
        return self._landed_host().tolist()

    def any(self) -> bool:
        """Whether any value is nonzero, read as `tolist` reads (one op, no list)."""
        return bool(self._landed_host().any())

    def _landed_host(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


def to_host(tensor: torch.Tensor) -> HostCopy:
    return HostCopy(tensor)
