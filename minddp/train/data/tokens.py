"""Token folders as people bring them (`data=tokens`), checked before a step runs.

One layout per folder:
  nanoGPT        train.bin, val.bin: headerless ids (uint16 unless data.dtype says otherwise),
                 meta.pkl with vocab_size (and itos/stoi for character-level data)
  llm.c          *_train_*.bin, *_val_*.bin shards: 256 int32 of header (magic 20240520,
                 version 1 = uint16 GPT-2 ids, 2 = uint32 llama-3 ids, token count), then ids
  build-nanogpt  *_train_*.npy, *_val_*.npy shards: np.save of uint16 ids

Whatever a file can get wrong (empty, a folder, shorter than a window, a bad header, an id
past the vocabulary anywhere in it) is a ConfigError naming the file and the fix, raised
alike on every rank before the first step: a bad id met mid-training would be a crash (on
CUDA a device-side assert), not a message. The id check reads every file once, in 1 MB
chunks (bounded memory): about 0.15 s per GB from the page cache on one idle core, the disk's
read speed when the file is not cached.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...errors import ConfigError
from ...io import safe_pickle

LLMC_MAGIC, LLMC_HEADER_INTS = 20240520, 256
# llm.c's dev/data/data_common.py: version -> (dtype, the tokenizer's vocabulary, its name)
LLMC_VERSIONS = {1: (np.uint16, 50_257, "GPT-2"), 2: (np.uint32, 128_256, "llama-3")}
BYTE_VOCAB = 256  # the default when nothing says otherwise: byte-level data
SCAN_BYTES = 1 << 20
_SPLITS = ("train", "val")


@dataclass
class Shard:
    path: Path
    tokens: np.ndarray  # a read-only memmap
    kind: str  # "nanoGPT bin" | "llm.c v1" | "llm.c v2" | "npy"


@dataclass
class TokenFolder:
    dir: Path
    splits: dict[str, list[Shard]]
    vocab_size: int = 0
    vocab_source: str = ""
    kinds: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ layouts
def _named(folder: Path, split: str, ext: str) -> list[Path]:
    """Shards whose name holds the split as a word (fineweb_train_000001.bin, not pretrain_val)."""
    word = re.compile(rf"(^|[_.\-]){split}([_.\-]|$)")
    return sorted(p for p in folder.glob(f"*{split}*{ext}")
                  if word.search(p.name) and p.name != f"{split}.bin")


def _layouts(folder: Path) -> dict[str, dict[str, list[Path]]]:
    found = {
        "nanogpt": {s: [folder / f"{s}.bin"] if (folder / f"{s}.bin").exists() else [] for s in _SPLITS},
        "llmc": {s: _named(folder, s, ".bin") for s in _SPLITS},
        "npy": {s: _named(folder, s, ".npy") for s in _SPLITS},
    }
    return {key: files for key, files in found.items() if any(files.values())}


LAYOUTS = {"nanogpt": "nanoGPT's train.bin/val.bin", "llmc": "llm.c shards (*_train_*.bin)",
           "npy": "build-nanogpt shards (*_train_*.npy)"}


def token_files(folder) -> tuple[str, dict[str, list[Path]]]:
    """(layout, {split: files}) of the one layout in `folder`; two, or a split missing, is an error."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"data.dir={str(folder)!r} is not a folder of token files")
    layouts = _layouts(folder)
    if not layouts:
        raise ConfigError(f"data.dir={str(folder)!r} holds no token files: nanoGPT's train.bin/val.bin, "
                          "llm.c's *_train_*.bin/*_val_*.bin or build-nanogpt's *_train_*.npy/*_val_*.npy "
                          "(write them with minddp prepare, or nanoGPT's / llm.c's scripts)")
    if len(layouts) > 1:
        named = [f"{LAYOUTS[key]}: {next(p.name for ps in files.values() for p in ps)}"
                 for key, files in layouts.items()]
        raise ConfigError(f"data.dir={str(folder)!r} holds two formats ({'; '.join(named)}): it is unclear "
                          "which to train on. Keep one format per folder (move the others elsewhere)")
    (layout, files), = layouts.items()
    for split in _SPLITS:
        if not files[split]:
            raise ConfigError(f"data.dir={str(folder)!r} has {LAYOUTS[layout]} for "
                              f"{'val' if split == 'train' else 'train'} but none for {split}: "
                              f"write the {split} split too")
    return layout, files


# ------------------------------------------------------------------ one file
def _check_file(path: Path) -> int:
    if path.is_dir():
        raise ConfigError(f"{path} is a folder, not a token file: move it away or point data.dir elsewhere")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    if size == 0:
        raise ConfigError(f"{path} is empty (0 bytes): an interrupted write? Re-run the script that wrote it")
    return size


def read_header(path) -> np.ndarray | None:
    """llm.c's 256 int32 header if the file starts with its magic number, else None."""
    with open(path, "rb") as f:
        raw = f.read(LLMC_HEADER_INTS * 4)
    if len(raw) < LLMC_HEADER_INTS * 4:  # shorter than a header (an odd size too): no header
        return None
    head = np.frombuffer(raw, dtype=np.int32)
    return head if head[0] == LLMC_MAGIC else None


def _llmc_header(path: Path, size: int) -> np.ndarray:
    """The header of a file that must be an llm.c shard: anything else is an error, not tokens."""
    if size < LLMC_HEADER_INTS * 4:
        raise ConfigError(f"{path}: {size} bytes, shorter than llm.c's {LLMC_HEADER_INTS * 4}-byte header: "
                          "truncated. Re-run the script that wrote it")
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(LLMC_HEADER_INTS * 4), dtype=np.int32)
    if not head.any():
        raise ConfigError(f"{path}: the llm.c header is all zeros (a shard whose write never finished): "
                          "re-run the script that wrote it")
    if head[0] != LLMC_MAGIC:
        raise ConfigError(f"{path}: magic number {int(head[0])}, not llm.c's {LLMC_MAGIC}: not an llm.c "
                          "shard. Headerless ids belong in train.bin/val.bin (nanoGPT's layout)")
    return head


def _open_llmc(path: Path, size: int, head: np.ndarray) -> Shard:
    version, count = int(head[1]), int(head[2])
    if version not in LLMC_VERSIONS:
        raise ConfigError(f"{path}: llm.c header version {version} is unknown "
                          "(1 = uint16 GPT-2 ids, 2 = uint32 llama-3 ids)")
    dtype = np.dtype(LLMC_VERSIONS[version][0])
    body = size - LLMC_HEADER_INTS * 4
    if count < 0 or body != count * dtype.itemsize:
        raise ConfigError(f"{path}: the header says {count} tokens ({count * dtype.itemsize} bytes) "
                          f"but the file holds {body} bytes after it: truncated or not an llm.c shard")
    if count == 0:
        raise ConfigError(f"{path}: an llm.c shard with 0 tokens: re-run the script that wrote it")
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_INTS * 4, shape=(count,))
    return Shard(path, tokens, f"llm.c v{version}")


def _open_npy(path: Path) -> Shard:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise ConfigError(f"{path} is not a readable .npy array ({e}): truncated or not written by "
                          "np.save; re-run the script that wrote it") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
        raise ConfigError(f"{path} holds a {tokens.dtype} array of shape {tokens.shape}: token ids must be "
                          "a 1-D integer array (build-nanogpt writes uint16)")
    if len(tokens) == 0:
        raise ConfigError(f"{path} holds no tokens: re-run the script that wrote it")
    return Shard(path, tokens, "npy")


def headerless_dtype(dtype: str, vocab_size: int | None) -> str:
    if dtype != "auto":
        return dtype
    return "uint16" if vocab_size is None or vocab_size <= 2**16 else "uint32"


def open_shard(path, dtype: str = "auto", vocab_size: int | None = None, llmc: bool | None = None) -> Shard:
    """One token file as a memmap. llmc=True: it must carry llm.c's header; None: it may."""
    path = Path(path)
    size = _check_file(path)
    if path.suffix == ".npy":
        return _open_npy(path)
    if llmc or (llmc is None and read_header(path) is not None):
        return _open_llmc(path, size, _llmc_header(path, size))
    np_dtype = np.dtype(headerless_dtype(dtype, vocab_size))
    if size % np_dtype.itemsize:
        raise ConfigError(f"{path}: {size} bytes is not a whole number of {np_dtype} tokens; "
                          "set data.dtype to the dtype the file was written with")
    return Shard(path, np.memmap(path, dtype=np_dtype, mode="r"), "nanoGPT bin")


def open_tokens(path, dtype: str = "auto", vocab_size: int | None = None) -> np.ndarray:
    """The ids of one token file (llm.c's if it carries the header, else headerless)."""
    return open_shard(path, dtype, vocab_size).tokens


# ------------------------------------------------------------------ meta.pkl
def read_meta(folder) -> dict:
    """nanoGPT's meta.pkl (vocab_size, maybe itos/stoi), read without running any code."""
    path = Path(folder) / "meta.pkl"
    if not path.exists():
        return {}
    fix = ("re-run the script that wrote it (nanoGPT's prepare.py, minddp prepare), or delete it "
           "and set model.vocab_size")
    if path.is_dir():
        raise ConfigError(f"{path} is a folder, not nanoGPT's meta.pkl: remove it")
    try:
        meta = safe_pickle.load(path)
    except safe_pickle.UnsafePickleError as e:
        raise ConfigError(f"{path}: {e}. A meta.pkl holds a plain dict (vocab_size, itos, stoi); "
                          "rewrite it as one or delete it and set model.vocab_size") from None
    except Exception as e:  # noqa: BLE001 - a torn or foreign file raises any of a dozen types
        raise ConfigError(f"{path} cannot be read ({type(e).__name__}: {e}): truncated or not a pickle; "
                          f"{fix}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} holds a {type(meta).__name__}, not a dict with vocab_size; {fix}")
    v = meta.get("vocab_size")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ConfigError(f"{path}: vocab_size {v!r} is not a positive integer; {fix}")
    return meta


def declared_vocab(folder: Path, explicit: int | None,
                   vocab_from: str = "model.vocab_size") -> tuple[int | None, str]:
    """The vocabulary model.vocab_size (or model.init_from's folder: `vocab_from`) or meta.pkl gives
    (they must agree), and where it came from."""
    meta = read_meta(folder).get("vocab_size")
    if explicit and meta and explicit != meta and vocab_from.startswith("model.init_from"):
        raise ConfigError(f"{vocab_from} has a vocabulary of {explicit}, but {folder / 'meta.pkl'} says the "
                          f"data's is {meta}: {init_from_fix(explicit)}")
    if explicit and meta and explicit != meta:
        raise ConfigError(f"model.vocab_size={explicit} disagrees with {folder / 'meta.pkl'}'s vocab_size "
                          f"{meta}: drop model.vocab_size to use the data's, or fix meta.pkl")
    if explicit:
        return explicit, "model.vocab_size"
    if meta:
        return meta, "meta.pkl"
    return None, ""


# ------------------------------------------------------------------ the folder
def open_folder(folder, dtype: str = "auto", explicit_vocab: int | None = None,
                block_size: int | None = None, vocab_from: str = "model.vocab_size") -> TokenFolder:
    """Every token file of the folder opened and checked; the vocabulary decided and verified.
    vocab_from: what set explicit_vocab (model.vocab_size, or model.init_from=<folder>)."""
    folder = Path(folder).resolve()
    layout, files = token_files(folder)
    vocab, source = declared_vocab(folder, explicit_vocab, vocab_from)
    llmc = True if layout == "llmc" else None  # shards must carry the header; train.bin may
    splits = {s: [open_shard(p, dtype, vocab, llmc) for p in paths] for s, paths in files.items()}
    shards = [sh for s in _SPLITS for sh in splits[s]]
    kinds = sorted({sh.kind for sh in shards})
    if len(kinds) > 1:
        a, b = (next(sh.path.name for sh in shards if sh.kind == k) for k in kinds[:2])
        raise ConfigError(f"{folder}: {a} is {kinds[0]} but {b} is {kinds[1]}: one folder, one format")
    if vocab is None:
        vocab, source = _default_vocab(kinds[0])
    result = TokenFolder(folder, splits, vocab, source, kinds)
    if block_size is not None:
        for split in _SPLITS:
            check_windows(splits[split], block_size, split)
    check_token_range(result, vocab_from)
    return result


def _default_vocab(kind: str) -> tuple[int, str]:
    if kind.startswith("llm.c v"):
        _, vocab, name = LLMC_VERSIONS[int(kind[-1])]
        return vocab, f"llm.c header version {kind[-1]} ({name})"
    return BYTE_VOCAB, "default (no model.vocab_size, no meta.pkl)"


def check_windows(shards: list[Shard], block_size: int, split: str) -> None:
    """Windows never span two shards: each split needs one shard of block_size+1 tokens."""
    if any(len(sh.tokens) > block_size for sh in shards):
        return
    names = ", ".join(str(sh.path) for sh in shards[:3]) + (", ..." if len(shards) > 3 else "")
    longest = max(len(sh.tokens) for sh in shards)
    raise ConfigError(f"{names}: the longest {split} file holds {longest} tokens, fewer than one window of "
                      f"model.block_size+1 = {block_size + 1}: use more data or a smaller model.block_size")


# ------------------------------------------------------------------ the id check
def scan_range(path, dtype, offset: int, count: int, chunk_bytes: int = SCAN_BYTES,
               limit: int | None = None) -> tuple[int, int, int | None]:
    """(smallest id, largest id, index of the first id >= limit or None) over the whole file,
    read in chunks into one buffer: plain reads, not the memmap, so the file's pages are not
    mapped into this process. The pages read are dropped from the page cache after: recent
    kernels cache them as large folios that the training memmap would then map whole (a 300 MB
    file: +75 MB resident after 3 steps, against +7 MB without them)."""
    dtype = np.dtype(dtype)
    per = max(1, min(count, chunk_bytes // dtype.itemsize))
    buf = bytearray(per * dtype.itemsize)
    lo, hi, first, done = 0, 0, None, 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < count:
            n = min(per, count - done)
            got = f.readinto(memoryview(buf)[: n * dtype.itemsize])
            if got != n * dtype.itemsize:
                raise ConfigError(f"{path} became shorter while it was read: is something rewriting it?")
            part = np.frombuffer(buf, dtype=dtype, count=n)
            hi = max(hi, int(part.max()))
            if dtype.kind == "i":
                lo = min(lo, int(part.min()))
            if limit is not None and first is None and hi >= limit:
                first = done + int(np.argmax(part >= limit))
            done += n
        if hasattr(os, "posix_fadvise"):  # Linux: leave the page cache as training would find it
            os.posix_fadvise(f.fileno(), offset, count * dtype.itemsize, os.POSIX_FADV_DONTNEED)
    return lo, hi, first


def check_token_range(folder: TokenFolder, vocab_from: str = "model.vocab_size") -> None:
    """An id >= the vocabulary would index past the embedding: every file is read once."""
    for split in _SPLITS:
        for sh in folder.splits[split]:
            t = sh.tokens
            if t.dtype.kind == "u" and np.iinfo(t.dtype).max < folder.vocab_size:
                continue  # every value of the dtype fits: nothing to read
            lo, hi, first = scan_range(sh.path, t.dtype, t.offset, len(t), limit=folder.vocab_size)
            if lo < 0:
                raise ConfigError(f"{sh.path} holds a negative token id ({lo}): not token ids, or the "
                                  "wrong dtype")
            if first is not None:
                raise ConfigError(f"{sh.path} holds token id {hi} (the first too large one at token {first}) "
                                  f"but the vocabulary has {folder.vocab_size} tokens: "
                                  f"{_range_fix(folder, hi, vocab_from)}")


def _range_fix(folder: TokenFolder, top: int, vocab_from: str = "model.vocab_size") -> str:
    src = folder.vocab_source
    if src == "model.vocab_size" and vocab_from != src:  # model.init_from=<folder>: its vocabulary
        return f"the data is not in the tokens of {vocab_from}; {init_from_fix(folder.vocab_size)}"
    if src == "model.vocab_size":
        return f"set model.vocab_size > {top}, or check data.dtype"
    if src == "meta.pkl":
        return (f"the ids do not match {folder.dir / 'meta.pkl'}; re-run the script that wrote both, "
                "or check data.dtype")
    if src.startswith("llm.c"):
        return f"{src} says {folder.vocab_size}; set model.vocab_size > {top} for this tokenizer"
    return (f"no model.vocab_size and no meta.pkl gave one, so {BYTE_VOCAB} was assumed; "
            f"set model.vocab_size > {top} (50257 for GPT-2 ids), or check data.dtype")


def init_from_fix(vocab: int) -> str:
    """Which data a model of this vocabulary (model.init_from's) trains on."""
    gpt2 = vocab in (50_257, 50_304)
    which = " (GPT-2's tokenizer: nanoGPT's or llm.c's GPT-2 token files)" if gpt2 else ""
    bytes_ = "" if vocab == BYTE_VOCAB else (f"; data=text (bytes) needs a model of vocabulary {BYTE_VOCAB}, "
                                             "such as a minddp export of a data=text run")
    return (f"train it on data in its own tokens: data=tokens data.dir=<a folder of ids < {vocab}, prepared "
            f"with that model's tokenizer{which}>{bytes_}")
