"""What a run trains on: token files read through a memmap, a text corpus, or a synthetic task.

One reader for every source: a folder of token files (`data=tokens`: nanoGPT's, llm.c's or
build-nanogpt's layout, opened and checked in tokens.py), byte-level text (`data=text`,
cached once as a token file of bytes), and a synthetic task. Every data set
is map-style and yields windows of `block_size + 1` token ids; a batch's inputs are the
first `block_size` and its targets the last. Windows never span two shards.
Each rank's batches: batches.py.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ...errors import ConfigError
from ...io.atomic import atomic_write
from ..safety.together import together
from . import tokens
from .fingerprint import fingerprint


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
            raise ConfigError(f"data.path={path or str(stdlib_root())!r} holds no text: give a text file "
                              "or a folder of them")
        atomic_write(cache, b"".join(chunks))
    return tokens.open_tokens(cache, "uint8")


@dataclass
class DataInfo:
    """What a run trains on, as it was found: for the start-up line, run.json, W&B and the config."""

    format: str  # nanoGPT bin | llm.c shards v1 | llm.c shards v2 | npy shards | bytes corpus | synthetic
    vocab_size: int
    vocab_source: str
    dir: str | None = None
    files: dict = field(default_factory=dict)  # split -> number of files
    tokens: dict = field(default_factory=dict)  # split -> number of tokens
    dtype: str | None = None  # of the token ids on disk
    fingerprint: str | None = None  # of the files read (fingerprint.py); None: synthetic

    def summary(self) -> str:
        parts = [self.format + (f" {self.dtype}" if self.dtype else "")]
        if self.files:
            parts.append(" + ".join(f"{n} {s}" for s, n in self.files.items()) + " files")
        if self.tokens:
            parts.append(" / ".join(f"{n:,} {s}" for s, n in self.tokens.items()) + " tokens")
        parts.append(f"vocabulary {self.vocab_size} ({self.vocab_source})")
        return "data " + ", ".join(parts) + (f" from {self.dir}" if self.dir else "")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_FORMATS = {"nanoGPT bin": "nanoGPT bin", "llm.c v1": "llm.c shards v1 (GPT-2)",
            "llm.c v2": "llm.c shards v2 (llama-3)", "npy": "npy shards (build-nanogpt)"}


def load_tokens(data_cfg, block_size: int, vocab_size: int | None = None, init_from: str | None = None):
    """(train, val, info) of a data=tokens folder, every file opened and checked."""
    if not Path(data_cfg.dir).is_dir():
        raise ConfigError(f"data.dir={data_cfg.dir!r} is not a folder: data=tokens needs data.dir=<folder of "
                          "token files>")
    folder = tokens.open_folder(data_cfg.dir, data_cfg.dtype, vocab_size, block_size, _vocab_from(init_from))
    sets = {s: TokenWindows([sh.tokens for sh in shards], block_size) for s, shards in folder.splits.items()}
    info = DataInfo(_FORMATS[folder.kinds[0]], folder.vocab_size, folder.vocab_source, str(folder.dir),
                    {s: len(v) for s, v in folder.splits.items()},
                    {s: sum(len(sh.tokens) for sh in v) for s, v in folder.splits.items()},
                    str(folder.splits["train"][0].tokens.dtype),
                    fingerprint([sh.path for v in folder.splits.values() for sh in v]))
    return sets["train"], sets["val"], info


def _load_text(data_cfg, block_size: int, vocab_size: int | None,
               init_from: str | None = None) -> tuple[Dataset, Dataset, DataInfo]:
    if init_from and vocab_size != tokens.BYTE_VOCAB:  # its ids are another tokenizer's, not bytes
        raise ConfigError(f"{_vocab_from(init_from)} has a vocabulary of {vocab_size}, but data=text's ids "
                          f"are bytes (a vocabulary of 256): {tokens.init_from_fix(vocab_size)}")
    if vocab_size and vocab_size < tokens.BYTE_VOCAB:
        raise ConfigError(f"model.vocab_size={vocab_size} is too small for data=text: its ids are bytes "
                          "(0-255); drop model.vocab_size or set it >= 256")
    if data_cfg.path is not None and not Path(data_cfg.path).exists():
        raise ConfigError(f"data.path={data_cfg.path!r} does not exist: give a text file or a folder")
    ids = load_corpus(data_cfg.path, data_cfg.max_bytes, data_cfg.cache_dir)
    split = int(len(ids) * (1 - data_cfg.val_fraction))
    parts = {"train": ids[:split], "val": ids[split:]}
    for name, part in parts.items():
        if len(part) <= block_size:
            raise ConfigError(f"data=text: the {name} split holds {len(part)} bytes, fewer than one "
                              f"window of model.block_size+1 = {block_size + 1}: use more text "
                              "(data.max_bytes, data.path), another data.val_fraction or a smaller "
                              "model.block_size")
    info = DataInfo("bytes corpus", vocab_size or tokens.BYTE_VOCAB,
                    "model.vocab_size" if vocab_size else "bytes", data_cfg.path,
                    tokens={k: len(v) for k, v in parts.items()}, dtype="uint8",
                    fingerprint=fingerprint([ids.filename]))
    return TokenWindows(parts["train"], block_size), TokenWindows(parts["val"], block_size), info


def _vocab_from(init_from: str | None) -> str:
    """What set model.vocab_size: the command line (or its default), or model.init_from's folder."""
    return f"model.init_from={init_from}" if init_from else "model.vocab_size"


def load_data(data_cfg, block_size: int, vocab_size: int | None = None,
              init_from: str | None = None) -> tuple[Dataset, Dataset, DataInfo]:
    """(train, val, what was found). vocab_size: model.vocab_size, None when not given; init_from:
    model.init_from's folder, whose vocabulary vocab_size then is (the data must be in its tokens)."""
    if data_cfg.name == "tokens":
        return load_tokens(data_cfg, block_size, vocab_size, init_from)
    if data_cfg.name == "text":
        return _load_text(data_cfg, block_size, vocab_size, init_from)
    if data_cfg.name == "synthetic":
        vocab = vocab_size or tokens.BYTE_VOCAB
        if data_cfg.modulus > vocab:
            raise ConfigError(f"data.modulus={data_cfg.modulus} exceeds model.vocab_size={vocab}: "
                              "the ids would index past the embedding")
        train = ArithmeticSequences(data_cfg.num_samples, block_size, data_cfg.modulus)
        val = ArithmeticSequences(data_cfg.num_val, block_size, data_cfg.modulus, offset=10**9)
        return train, val, DataInfo("synthetic", vocab, "model.vocab_size" if vocab_size else "default")
    raise ValueError(f"unknown data set {data_cfg.name!r}: use data=tokens, data=text or data=synthetic")


def load_data_agreed(data_cfg, block_size: int, vocab_size: int | None = None, init_from: str | None = None):
    """`load_data` on every rank, then one collective before any other: a rank whose files are
    broken, or differ from rank 0's (another fingerprint), is the same one-line error on every
    rank, at once, instead of one rank exiting while the others wait for it."""
    result, error = None, None
    try:
        result = load_data(data_cfg, block_size, vocab_size, init_from)
    except Exception as e:  # noqa: BLE001 - raised on every rank by together
        error = e
    info = result[2] if result else None
    seen = together(error, info and (info.fingerprint, info.dir or data_cfg.get("path")))
    if len({fp for fp, _ in seen}) > 1:
        ranks = "; ".join(f"rank {r}: {fp} from {where}" for r, (fp, where) in enumerate(seen))
        raise ConfigError(f"the ranks read different data (fingerprints {ranks}): every rank must read "
                          "the same files; give every node the same data.dir/data.path contents")
    return result


def record_in_config(cfg, info: DataInfo) -> None:
    """The effective vocabulary and the absolute data folder into the run's config, so the saved
    config, run.json and W&B say what was used and `minddp sample` finds the data from anywhere."""
    cfg.model.vocab_size = info.vocab_size
    if cfg.data.name == "tokens":
        cfg.data.dir = info.dir
