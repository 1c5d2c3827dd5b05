"""Data: byte-level text and a synthetic task, sharded with DistributedSampler.

Every data set is map-style and yields windows of `block_size + 1` token ids;
a batch's inputs are the first `block_size` and its targets the last.

Sharding keeps the loss curve independent of how the global batch is split:
the sampler's permutation depends only on (seed, epoch), rank r takes
positions r, r+dp, r+2dp, ..., and each step consumes a contiguous run of its
shard, so step s covers global positions [s*G, (s+1)*G) for any dp size.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler


class TokenWindows(Dataset):
    """Non-overlapping windows of block_size+1 tokens over one token array."""

    def __init__(self, tokens: np.ndarray, block_size: int):
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of block_size+1={block_size + 1}")
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.block_size
        return torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))


class ArithmeticSequences(Dataset):
    """Sample i: start + stride * t (mod m), both drawn from a generator seeded by i.

    Deterministic and learnable: after two tokens the rest of the window is
    predictable, so the loss falls quickly towards ~ln(m)*2/block_size.
    """

    def __init__(self, num_samples: int, block_size: int, modulus: int, offset: int = 0):
        self.n, self.block_size, self.m, self.offset = num_samples, block_size, modulus, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = np.random.default_rng(self.offset + i)
        start, stride = int(g.integers(self.m)), int(g.integers(1, self.m))
        return torch.from_numpy((start + stride * np.arange(self.block_size + 1)) % self.m)


# ---------------------------------------------------------------- text corpus
def _text_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"data.path={str(root)!r} is neither a file nor a folder")
    files = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and "site-packages" not in p.parts:
            with open(p, "rb") as f:
                if b"\0" not in f.read(1024):  # skip binaries
                    files.append(p)
    return files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(path: str | None, max_bytes: int, cache_dir: str) -> np.ndarray:
    """The corpus as uint8 bytes, cached as .npy (written atomically, so ranks may race)."""
    root = Path(path) if path else stdlib_root()
    key = hashlib.sha1(f"{root.resolve()}|{max_bytes}|{sys.version}".encode()).hexdigest()[:16]
    cache = Path(cache_dir) / f"corpus-{key}.npy"
    if cache.exists():
        return np.load(cache, mmap_mode="r")
    pattern = "*.py" if path is None else None
    files = sorted(root.rglob(pattern)) if pattern else _text_files(root)
    files = [f for f in files if f.is_file() and "site-packages" not in f.parts]
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes()
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise ValueError(f"no text found under {root}")
    arr = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, arr)
    os.replace(tmp, cache)
    return arr


def build_datasets(data_cfg, block_size: int) -> tuple[Dataset, Dataset]:
    if data_cfg.name == "text":
        tokens = load_corpus(data_cfg.path, data_cfg.max_bytes, data_cfg.cache_dir)
        split = int(len(tokens) * (1 - data_cfg.val_fraction))
        return TokenWindows(tokens[:split], block_size), TokenWindows(tokens[split:], block_size)
    if data_cfg.name == "synthetic":
        train = ArithmeticSequences(data_cfg.num_samples, block_size, data_cfg.modulus)
        val = ArithmeticSequences(data_cfg.num_val, block_size, data_cfg.modulus, offset=10**9)
        return train, val
    raise ValueError(f"unknown data set {data_cfg.name!r}: use data=text or data=synthetic")


def collate(dataset: Dataset, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.stack([dataset[i] for i in indices]).to(device, non_blocking=True)
    return w[:, :-1], w[:, 1:]


class ShardedBatches:
    """This rank's micro-batches for any optimizer step: resumable from the step alone."""

    def __init__(self, dataset, dp_size, dp_rank, micro_batch, accum, seed, device):
        self.dataset, self.micro, self.accum, self.device = dataset, micro_batch, accum, device
        self.sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank,
                                          shuffle=True, seed=seed, drop_last=True)
        self.steps_per_epoch = len(self.sampler) // (micro_batch * accum)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training set has {len(dataset)} samples, fewer than one global batch "
                f"({micro_batch * accum * dp_size}): use more data or a smaller train.global_batch_size")
        self.epoch, self._indices = None, None

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global optimizer step."""
        return divmod(step, self.steps_per_epoch)

    def get(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        epoch, k = self.position(step)
        if epoch != self.epoch:
            self.sampler.set_epoch(epoch)  # a new order every epoch
            self.epoch, self._indices = epoch, list(self.sampler)
        per_step = self.micro * self.accum
        idx = self._indices[k * per_step : (k + 1) * per_step]
        return [collate(self.dataset, idx[m * self.micro : (m + 1) * self.micro], self.device)
                for m in range(self.accum)]


@torch.no_grad()
def evaluate(model, dataset, dp_rank, dp_size, micro_batch, max_samples, device, group=None,
             autocast=None) -> float:
    """Exact mean token loss over the first max_samples samples (all if 0), for any dp size.

    Rank r takes samples r, r+dp, ...: no padding, so nothing is counted twice;
    sums and counts are all-reduced, so shards of unequal length are exact too.
    `model` must be the unwrapped module (its forward issues no data-parallel
    collectives, so ranks may run different numbers of batches).
    """
    n = len(dataset) if max_samples <= 0 else min(len(dataset), max_samples)
    mine = list(range(dp_rank, n, dp_size))
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for s in range(0, len(mine), micro_batch):
        x, y = collate(dataset, mine[s : s + micro_batch], device)
        with autocast() if autocast else torch.autocast(device.type, enabled=False):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
        total += torch.stack([loss.double(), torch.tensor(y.numel(), dtype=torch.float64, device=device)])
    dist.all_reduce(total, group=group)
    model.train(was_training)
    return (total[0] / total[1]).item()
