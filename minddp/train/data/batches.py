"""This rank's micro-batches for any optimizer step, sharded with DistributedSampler.

Sharding keeps the loss curve independent of how the global batch is split:
the sampler's permutation depends only on (seed, epoch), rank r takes
positions r, r+dp, r+2dp, ..., and each step consumes a contiguous run of its
shard, so step s covers global samples [s*G, (s+1)*G) for any dp size: a run
can resume on another number of ranks and see the same samples.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, DistributedSampler

from ...errors import ConfigError


def collate(dataset: Dataset, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) on `device`: one copy from pinned memory on CUDA (truly asynchronous)."""
    w = dataset.batch(indices) if hasattr(dataset, "batch") else torch.stack([dataset[i] for i in indices])
    if device.type == "cuda":
        w = w.pin_memory().to(device, non_blocking=True)
    else:
        w = w.to(device)
    return w[:, :-1], w[:, 1:]


class ShardedBatches:
    """This rank's micro-batches for any optimizer step: resumable from the step alone."""

    def __init__(self, dataset, dp_size, dp_rank, micro_batch, accum, seed, device):
        self.dataset, self.micro, self.accum, self.device = dataset, micro_batch, accum, device
        self.global_batch = micro_batch * accum * dp_size
        self.sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank,
                                          shuffle=True, seed=seed, drop_last=True)
        self.steps_per_epoch = len(self.sampler) // (micro_batch * accum)  # = len // global: any dp
        if self.steps_per_epoch == 0:  # a configuration error: exit 2 on every rank, no traceback
            raise ConfigError(
                f"the training set has {len(dataset)} samples, fewer than one global batch "
                f"({self.global_batch}): use more data or a smaller train.global_batch_size")
        self.epoch, self._indices = None, None

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global optimizer step."""
        return divmod(step, self.steps_per_epoch)

    def samples_seen(self, step: int) -> int:
        """Global sample index after `step` steps: the same for any number of ranks."""
        return step * self.global_batch

    def get(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        epoch, k = self.position(step)
        if epoch != self.epoch:
            self.epoch, self._indices = epoch, self.epoch_indices(epoch)  # a new order every epoch
        per_step = self.micro * self.accum
        idx = self._indices[k * per_step : (k + 1) * per_step].tolist()
        return [collate(self.dataset, idx[m * self.micro : (m + 1) * self.micro], self.device)
                for m in range(self.accum)]

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """Exactly `DistributedSampler(shuffle=True, drop_last=True)`'s order after set_epoch(epoch),
        kept as one int64 tensor: a Python list of every window index would cost ~36 bytes
        per window, and grow with the data set."""
        s = self.sampler
        g = torch.Generator()
        g.manual_seed(s.seed + epoch)
        perm = torch.randperm(len(self.dataset), generator=g)[: s.total_size]
        return perm[s.rank : s.total_size : s.num_replicas].clone()
