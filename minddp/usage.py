"""Which parameters some rank left without a gradient: flags that ride in the last bucket.

Each rank writes one flag per parameter into the last bucket's tail before it is reduced:
"unused here" (or "used here" with find_unused_parameters). After the sum or average, nonzero
means "on some rank", in any dtype, at no extra collective. Nothing here blocks the host:
the flags go in from pinned memory and come back to it without waiting (minddp.transfer);
the next forward reads them and raises on every rank, where torch DDP raises too. Only
find_unused_parameters needs them at once (which .grad to restore before the optimizer
step): one host read per step, as in torch DDP's reducer.
"""

from __future__ import annotations

from . import ddp_checks as checks
from . import transfer


class UsageFlags:
    def __init__(self, names: list[str], find_unused_parameters: bool):
        self.names, self.find_unused = names, find_unused_parameters
        self._pending = None  # the last backward's flags, on their way to the host

    def write(self, tail, ready: list[bool]) -> None:
        transfer.copy_into(tail, [r == self.find_unused for r in ready])

    def reduced(self, tail, ready: list[bool], layout, params) -> None:
        """The flags are reduced (`tail`: None when this rank holds only a shard of them)."""
        if tail is None:  # reduce-scatter (ZeRO-1): this rank can check its own use only
            return checks.check_used_here(self.names, ready)
        if self.find_unused:
            return _restore_grads(transfer.to_host(tail).tolist(), layout, params)
        self._pending = transfer.to_host(tail), list(ready)

    def check(self) -> None:
        """At the next forward: a parameter some rank left unused is an error, on every rank."""
        if self._pending is not None:
            (flags, ready), self._pending = self._pending, None
            unused = [v != 0 for v in flags.tolist()]
            if any(unused):
                checks.unused_parameters_error(self.names, unused, ready)


def _restore_grads(flags: list, layout, params) -> None:
    """.grad as torch DDP leaves it: the averaged view for a parameter used on some rank,
    untouched (None if it was) for one unused everywhere."""
    for bucket in layout.buckets:
        for i, grad_was_none in bucket.unused:
            if flags[i] != 0:
                params[i].grad = layout.views[i]
            elif grad_was_none:
                params[i].grad = None
