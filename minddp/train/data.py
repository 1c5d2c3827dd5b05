"""Data: token files read through a memmap, sharded with DistributedSampler.

One reader for every source: a folder of token files (`data=tokens`: nanoGPT's headerless
`train.bin`/`val.bin`, or llm.c's shards with a 1024-byte header), byte-level text
(`data=text`, cached once as a token file of bytes), and a synthetic task. Every data set
is map-style and yields windows of `block_size + 1` token ids; a batch's inputs are the
first `block_size` and its targets the last. Windows never span two shards.

Sharding keeps the loss curve independent of how the global batch is split:
the sampler's permutation depends only on (seed, epoch), rank r takes
positions r, r+dp, r+2dp, ..., and each step consumes a contiguous run of its
shard, so step s covers global samples [s*G, (s+1)*G) for any dp size: a run
can resume on another number of ranks and see the same samples.
"""

from __future__ import annotations

import bisect
import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from ..errors import ConfigError
from . import safe_pickle
from .atomic import atomic_write

LLMC_MAGIC, LLMC_HEADER_INTS = 20240520, 256
_LLMC_DTYPES = {1: np.uint16, 2: np.uint32}


class TokenWindows(Dataset):
    """Non-overlapping windows of block_size+1 tokens over one or more token arrays
    (memmaps: nothing is read until a window is asked for)."""

    def __init__(self, shards, block_size: int):
        shards = shards if isinstance(shards, (list, tuple)) else [shards]
        counts = [max(0, (len(s) - 1) // block_size) for s in shards]
        if sum(counts) == 0:
            raise ValueError(f"{sum(len(s) for s in shards)} tokens cannot fill one window of "
                             f"block_size+1={block_size + 1}")
        self.shards, self.block_size = shards, block_size
        self.ends = np.cumsum(counts).tolist()  # window index where each shard ends

    def __len__(self) -> int:
        return self.ends[-1]

    def window(self, i: int) -> np.ndarray:
        s = bisect.bisect_right(self.ends, i)
        start = (i - (self.ends[s - 1] if s else 0)) * self.block_size
        return self.shards[s][start : start + self.block_size + 1]

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.window(i).astype(np.int64))

    def batch(self, indices) -> torch.Tensor:
        """One (len(indices), block_size+1) int64 tensor, in one copy."""
        return torch.from_numpy(np.stack([self.window(i) for i in indices]).astype(np.int64))


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


# ---------------------------------------------------------------- token files
def read_header(path) -> np.ndarray | None:
    """llm.c's 256 int32 header if the file starts with its magic number, else None."""
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(LLMC_HEADER_INTS * 4), dtype=np.int32)
    return head if len(head) == LLMC_HEADER_INTS and head[0] == LLMC_MAGIC else None


def open_tokens(path, dtype="auto", vocab_size: int | None = None) -> np.memmap:
    """A memmap of one token file: llm.c's (header decides the dtype) or headerless."""
    path = Path(path)
    header = read_header(path)
    if header is not None:
        version, count = int(header[1]), int(header[2])
        if version not in _LLMC_DTYPES:
            raise ConfigError(f"{path}: llm.c header version {version} is unknown (1 = uint16, 2 = uint32)")
        np_dtype = np.dtype(_LLMC_DTYPES[version])
        body = path.stat().st_size - LLMC_HEADER_INTS * 4
        if body != count * np_dtype.itemsize:
            raise ConfigError(f"{path}: the header says {count} tokens ({count * np_dtype.itemsize} bytes) "
                              f"but the file holds {body} bytes after it: truncated or not an llm.c shard")
        return np.memmap(path, dtype=np_dtype, mode="r", offset=LLMC_HEADER_INTS * 4, shape=(count,))
    np_dtype = np.dtype(headerless_dtype(dtype, vocab_size))
    if path.stat().st_size % np_dtype.itemsize:
        raise ConfigError(f"{path}: {path.stat().st_size} bytes is not a whole number of {np_dtype} tokens; "
                          "set data.dtype to the dtype the file was written with")
    return np.memmap(path, dtype=np_dtype, mode="r")


def headerless_dtype(dtype: str, vocab_size: int | None) -> str:
    if dtype != "auto":
        return dtype
    return "uint16" if vocab_size is None or vocab_size <= 2**16 else "uint32"


def read_meta(folder) -> dict:
    """nanoGPT's meta.pkl (vocab_size, maybe itos/stoi), read without running any code."""
    path = Path(folder) / "meta.pkl"
    if not path.exists():
        return {}
    try:
        meta = safe_pickle.load(path)
    except safe_pickle.UnsafePickleError as e:
        raise ConfigError(f"{path}: {e}. A meta.pkl holds a plain dict (vocab_size, itos, stoi); "
                          "rewrite it as one or delete it and set model.vocab_size") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} holds a {type(meta).__name__}, not a dict with vocab_size")
    return meta


def token_files(folder, split: str) -> list[Path]:
    """nanoGPT's <split>.bin, or llm.c's shards whose names contain the split, in name order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"data.dir={str(folder)!r} is not a folder of token files")
    exact = folder / f"{split}.bin"
    files = [exact] if exact.exists() else sorted(p for p in folder.glob(f"*{split}*.bin") if p.is_file())
    if not files:
        raise ConfigError(f"data.dir={str(folder)!r} has no {split}.bin and no *{split}*.bin shards "
                          "(write them with minddp prepare, or nanoGPT's / llm.c's scripts)")
    return files


def token_range_max(path, dtype, offset: int, count: int, head: int = 1 << 20,
                    chunks: int = 256, chunk: int = 4096) -> int:
    """The largest token id in a bounded sample: the first `head` tokens plus `chunks`
    evenly spaced runs of `chunk` tokens. Plain reads, not the memmap: a strided pass
    through a memmap would map every page of a many-GB file into this process."""
    dtype = np.dtype(dtype)
    starts = [0]
    if count > chunk:
        starts += [int(i * (count - chunk) / max(1, chunks - 1)) for i in range(chunks)]
    top = 0
    with open(path, "rb") as f:
        for k, start in enumerate(starts):
            n = min(head if k == 0 else chunk, count - start)
            f.seek(offset + start * dtype.itemsize)
            part = np.frombuffer(f.read(max(0, n) * dtype.itemsize), dtype=dtype)
            if len(part):
                top = max(top, int(part.max()))
    return top


def check_token_range(shards, vocab_size: int, where: str) -> None:
    """A token id >= vocab_size would index past the embedding: fail before training."""
    for path, arr in shards:
        if not len(arr):
            continue
        top = token_range_max(path, arr.dtype, arr.offset, len(arr))
        if top >= vocab_size:
            raise ConfigError(f"{path} holds token id {top} but the vocabulary has {vocab_size} tokens "
                              f"({where}); set model.vocab_size > {top} or check data.dtype")


def load_tokens(data_cfg, block_size: int, vocab_size: int) -> tuple[Dataset, Dataset]:
    splits = {}
    for split in ("train", "val"):
        files = token_files(data_cfg.dir, split)
        shards = [(p, open_tokens(p, data_cfg.dtype, vocab_size)) for p in files]
        check_token_range(shards, vocab_size, "model.vocab_size, or meta.pkl's vocab_size")
        splits[split] = TokenWindows([a for _, a in shards], block_size)
    return splits["train"], splits["val"]


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


def corpus_files(path: str | None) -> list[Path]:
    root = Path(path) if path else stdlib_root()
    files = sorted(root.rglob("*.py")) if path is None else _text_files(root)
    return [f for f in files if f.is_file() and "site-packages" not in f.parts]


def corpus_key(files: list[Path], max_bytes: int) -> str:
    """Changes when any file is added, removed, resized or touched."""
    h = hashlib.sha1(str(max_bytes).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def load_corpus(path: str | None, max_bytes: int, cache_dir: str) -> np.ndarray:
    """The corpus as a memmap of uint8 byte tokens, cached as a token file keyed on content
    (written under a unique temporary name, then renamed: ranks and jobs may race)."""
    files = corpus_files(path)
    cache = Path(cache_dir) / f"corpus-{corpus_key(files, max_bytes)}.bin"
    if not cache.exists():
        chunks, total = [], 0
        for f in files:
            chunks.append(f.read_bytes()[: max_bytes - total])
            total += len(chunks[-1])
            if total >= max_bytes:
                break
        if total == 0:
            raise ValueError(f"no text found under {path or stdlib_root()}")
        atomic_write(cache, b"".join(chunks))
    return open_tokens(cache, "uint8")


def vocab_size_of(data_cfg, model_vocab: int) -> int:
    """meta.pkl's vocab_size for token folders that have one, else the model's."""
    if data_cfg.name == "tokens":
        return int(read_meta(data_cfg.dir).get("vocab_size", model_vocab))
    return model_vocab


def build_datasets(data_cfg, block_size: int, vocab_size: int = 256) -> tuple[Dataset, Dataset]:
    if data_cfg.name == "tokens":
        return load_tokens(data_cfg, block_size, vocab_size)
    if data_cfg.name == "text":
        tokens = load_corpus(data_cfg.path, data_cfg.max_bytes, data_cfg.cache_dir)
        split = int(len(tokens) * (1 - data_cfg.val_fraction))
        return TokenWindows(tokens[:split], block_size), TokenWindows(tokens[split:], block_size)
    if data_cfg.name == "synthetic":
        train = ArithmeticSequences(data_cfg.num_samples, block_size, data_cfg.modulus)
        val = ArithmeticSequences(data_cfg.num_val, block_size, data_cfg.modulus, offset=10**9)
        return train, val
    raise ValueError(f"unknown data set {data_cfg.name!r}: use data=tokens, data=text or data=synthetic")


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
        if self.steps_per_epoch == 0:
            raise ValueError(
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
