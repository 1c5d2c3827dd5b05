"""A modelled network link for the benchmarks: communication that takes wall time and no CPU.

`Link(gbps, latency_s)` is one rank's link, serial as a network card is: a bucket handed to it
at time t starts when the link is free (t, or the previous bucket's end, whichever is later)
and ends `latency_s + bytes / bandwidth` later. `link_hook` is a comm hook with torch DDP's
shape: `ddp.register_comm_hook(Link(...), link_hook)` works on torch DDP and minddp alike, so
every engine compared sends its buckets over the same model. It divides the bucket by the world
size (the gradients keep an average's magnitude) and returns a future that a timer thread
completes when the bucket's transfer ends. The gradients are NOT averaged across ranks: this is
a timing model, for benchmarks only. The thread sleeps meanwhile, so the compute stays real and
the engine's overlap alone decides how much of the transfer the backward hides.

`Link.sent_s` adds up the modelled transfers. `Link.tail_s()`: how long the link still
transferred after the last bucket of the last step was handed to it (what the backward, over
by then, could not hide): about the last bucket's transfer with overlap, the whole transfer
when every bucket goes out at the end.
"""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist


class Link:
    """One rank's modelled link: `gbps` Gbit/s, `latency_s` per bucket, buckets in turn."""

    def __init__(self, gbps: float, latency_s: float = 50e-6):
        if gbps <= 0:
            raise ValueError(f"a link needs a bandwidth above 0 Gbit/s, got {gbps}")
        self.gbps, self.latency_s = gbps, latency_s
        self.free_at = 0.0  # perf_counter time when the last bucket handed over ends
        self.last = (0.0, 0.0)  # (handed over, ends) of the last bucket
        self.sent_s = 0.0  # modelled transfer time of every bucket so far
        self._due: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes * 8 / (self.gbps * 1e9)

    def send(self, tensor: torch.Tensor) -> torch.futures.Future:
        """A future completed with `tensor` when its transfer ends."""
        now, transfer = time.perf_counter(), self.transfer_s(tensor.numel() * tensor.element_size())
        self.free_at = max(now, self.free_at) + transfer
        self.sent_s += transfer
        self.last = (now, self.free_at)
        future = torch.futures.Future()
        self._deliverer().put((self.free_at, future, tensor))
        return future

    def tail_s(self) -> float:
        handed, ends = self.last
        return ends - handed

    def _deliverer(self) -> queue.SimpleQueue:
        if self._thread is None:
            self._thread = threading.Thread(target=self._deliver, name="minddp-link", daemon=True)
            self._thread.start()
        return self._due

    def _deliver(self) -> None:
        while True:  # ends in handing-over order: a serial link
            ends, future, tensor = self._due.get()
            time.sleep(max(0.0, ends - time.perf_counter()))
            future.set_result(tensor)


def link_hook(link: Link, bucket):
    """Comm hook (torch DDP's and minddp's `register_comm_hook(link, link_hook)`): the bucket,
    divided by the world size, over `link`; not reduced across ranks. A future of the bucket;
    unannotated: torch DDP accepts no return annotation but the object Future[Tensor], which a
    string annotation is not."""
    return link.send(bucket.buffer().div_(dist.get_world_size()))
