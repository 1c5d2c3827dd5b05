"""Which parameters some rank left without a gradient: flags that ride in the last bucket.

Each rank writes one flag per parameter into the last bucket's tail before it is reduced:
"unused here" (or "used here" with find_unused_parameters). After the sum or average, nonzero
means "on some rank", in any dtype, at no extra collective. With find_unused_parameters a
parameter counts as used if it got a gradient in any micro-step since the last synchronised
backward, no_sync() ones included (`used_unsynced`, torch's rule), so every rank keeps the
same averaged gradient.

Nothing here blocks the host: the flags go in from pinned memory and come back to it without
waiting (minddp.engine.transfer). A later forward reads them once their copy has landed (an event
query, no wait) and raises on every rank if some rank left a parameter unused, where torch
DDP raises too; a copy still in flight is looked at again at the next forwards, and waited
for at the `MAX_DEFER`-th, so the error comes on every rank within a bounded number of steps.
Only find_unused_parameters (and static_graph) needs the flags at once, and only on a rank that
left a parameter unused (which .grad to restore before the optimizer step): then one host read.
"""

from __future__ import annotations

import collections

import torch

from . import checks, grads, transfer

MAX_DEFER = 2  # forwards a usage check may wait for its flags' copy to land, before it waits


class UsageFlags:
    """`tolerate_unused`: find_unused_parameters or static_graph (a parameter unused on some rank
    is allowed, and its .grad restored as torch DDP leaves it); otherwise it is an error."""

    def __init__(self, names: list[str], tolerate_unused: bool):
        self.names, self.tolerate_unused = names, tolerate_unused
        # tolerate_unused: got a gradient in a no_sync() micro-step since the last sync
        self.used_unsynced = [False] * len(names)
        self._pending = collections.deque()  # [host copy, used, forwards seen]: oldest first

    def note_unsynced_use(self, i: int) -> None:
        """Parameter i got a gradient in a no_sync() micro-step (find_unused_parameters)."""
        self.used_unsynced[i] = True

    def write(self, tail, used: bytes) -> None:
        """The flags for `used` (one byte per parameter, nonzero: it got a gradient here) into
        the last bucket's tail: "used here" with tolerate_unused, else "unused here"."""
        if not self.tolerate_unused and 0 not in used:  # the default iteration: all used here
            tail.zero_()
            return
        used = torch.frombuffer(bytearray(used), dtype=torch.uint8).bool()
        if self.tolerate_unused:  # used in the synchronised micro-step or in an earlier no_sync() one
            used |= torch.tensor(self.used_unsynced)
        transfer.copy_into(tail, used if self.tolerate_unused else ~used)

    def unused_here(self, unused: list, param_ids) -> bool:
        """No parameter of a bucket (`unused`: its unused parameters this iteration) got a gradient
        on this rank since the last synchronised backward, in no_sync() micro-steps neither
        (skip_all_reduce_unused_params)."""
        return len(unused) == len(param_ids) and not any(self.used_unsynced[i] for i in param_ids)

    def reduced(self, tail, used: list[bool], unused: list[list], layout, params) -> None:
        """The flags are reduced (`tail`: None when this rank holds only a shard of them);
        `unused[b]`: bucket b's unused parameters this iteration, (index, its .grad was None)."""
        if tail is None:  # reduce-scatter (ZeRO-1): this rank can check its own use only
            return checks.check_used_here(self.names, used)
        if self.tolerate_unused:
            self.used_unsynced = [False] * len(self.names)
            if any(unused):  # only then does a .grad depend on other ranks
                grads.restore_unused(transfer.to_host(tail).tolist(), unused, layout.grad_views, params)
            return
        self._pending.append([transfer.to_host(tail), bytes(used), 0])

    def check(self) -> None:
        """At each forward: a parameter some rank left unused is an error, on every rank. Flags
        whose copy has not landed wait for a later forward (at most MAX_DEFER of them)."""
        while self._pending:
            entry = self._pending[0]
            copy, used, seen = entry
            if not copy.landed() and seen < MAX_DEFER:
                for e in self._pending:
                    e[2] += 1
                return
            self._pending.popleft()
            if copy.any():  # waits only past MAX_DEFER forwards
                self._pending.clear()
                checks.unused_parameters_error(self.names, [v != 0 for v in copy.tolist()], used)
