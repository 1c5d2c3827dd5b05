"""Text to token files: `minddp prepare INPUT --out DIR`.

    minddp prepare corpus.txt --out data/mine                      # bytes (vocab 256)
    minddp prepare texts/ --out data/mine --tokenizer bpe --vocab-size 4096

INPUT is a text file or a folder of them. Writes nanoGPT's layout, which `data=tokens
data.dir=DIR` trains on: headerless `train.bin` and `val.bin` (uint16 ids, uint32 past
65536), `meta.pkl` with `vocab_size`, and `tokenizer.json` for `minddp sample`.
`bpe` trains a byte-level BPE tokenizer with Hugging Face `tokenizers` on INPUT, offline.
Both passes stream the input, so a corpus larger than memory works; the last
--val-fraction of the bytes goes to val.bin.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..train.data import corpus_files

BYTES_TOKENIZER = {"type": "bytes", "vocab_size": 256}  # minddp's marker: ids are the raw bytes
_CHUNK_LINES = 2000


class PrepareError(ValueError):
    pass


def input_files(path: Path) -> list[Path]:
    if not path.exists():
        raise PrepareError(f"{path} does not exist: give a text file or a folder of text files")
    if path.is_file():
        with open(path, "rb") as f:
            if b"\0" in f.read(4096):
                raise PrepareError(f"{path} looks binary (it holds NUL bytes): give a text file")
        files = [path]
    else:
        files = corpus_files(str(path))  # text files only, binaries skipped
    if not files or sum(f.stat().st_size for f in files) == 0:
        raise PrepareError(f"{path} holds no text: nothing to tokenise")
    return files


def line_batches(files: list[Path], bar: tqdm | None = None):
    """Batches of lines (newlines kept) from every file, streaming."""
    for f in files:
        with open(f, "rb") as fh:
            batch = []
            for line in fh:
                batch.append(line)
                if bar is not None:
                    bar.update(len(line))
                if len(batch) == _CHUNK_LINES:
                    yield batch
                    batch = []
            if batch:
                yield batch


def train_bpe(files: list[Path], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="train BPE") as bar:
        texts = (b"".join(batch).decode("utf-8", errors="replace") for batch in line_batches(files, bar))
        tok.train_from_iterator(texts, trainer)
    return tok


def dtype_for(vocab_size: int) -> np.dtype:
    if vocab_size > 2**32:
        raise PrepareError(f"--vocab-size {vocab_size} does not fit uint32 token ids")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def encode_to_bins(files, out: Path, encode, dtype, val_fraction: float) -> dict:
    """Stream every line batch through `encode`; the last val_fraction of bytes -> val.bin."""
    total = sum(f.stat().st_size for f in files)
    val_from, seen, counts = total * (1 - val_fraction), 0, {"train": 0, "val": 0}
    with open(out / "train.bin", "wb") as train, open(out / "val.bin", "wb") as val, \
            tqdm(total=total, unit="B", unit_scale=True, desc="encode") as bar:
        for batch in line_batches(files, bar):
            for split, lines in _split_at(batch, val_from - seen if val_fraction > 0 else float("inf")):
                ids = np.asarray(encode(lines), dtype=dtype)
                ids.tofile(val if split == "val" else train)
                counts[split] += len(ids)
            seen += sum(len(line) for line in batch)
    return counts


def _split_at(lines: list[bytes], train_bytes_left: float):
    """The batch's lines before the val boundary (train) and from it on (val), non-empty parts only."""
    cut, pos = len(lines), 0
    for i, line in enumerate(lines):
        if pos >= train_bytes_left:
            cut = i
            break
        pos += len(line)
    return [(split, part) for split, part in (("train", lines[:cut]), ("val", lines[cut:])) if part]


def prepare(input_path, out, tokenizer: str = "bytes", vocab_size: int = 4096,
            val_fraction: float = 0.05) -> dict:
    files = input_files(Path(input_path))
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bytes":
        vocab_size = 256
        encode = lambda batch: np.frombuffer(b"".join(batch), dtype=np.uint8)  # noqa: E731
        (out / "tokenizer.json").write_text(json.dumps(BYTES_TOKENIZER))
    elif tokenizer == "bpe":
        if vocab_size <= 256:
            raise PrepareError(f"--vocab-size {vocab_size}: byte-level BPE needs more than its "
                               "256 base tokens")
        dtype_for(vocab_size)
        tok = train_bpe(files, vocab_size)
        vocab_size = tok.get_vocab_size()
        tok.save(str(out / "tokenizer.json"))
        encode = lambda batch: [i for e in tok.encode_batch(  # noqa: E731
            [b"".join(batch).decode("utf-8", errors="replace")]) for i in e.ids]
    else:
        raise PrepareError(f"--tokenizer must be bytes or bpe, got {tokenizer!r}")
    counts = encode_to_bins(files, out, encode, dtype_for(vocab_size), val_fraction)
    if counts["val"] == 0 or counts["train"] == 0:
        raise PrepareError(f"{input_path}: too little text to split into train and val "
                           f"({counts}); use more text or another --val-fraction")
    with open(out / "meta.pkl", "wb") as f:  # a plain dict: readable without running code
        pickle.dump({"vocab_size": vocab_size, "tokenizer": tokenizer}, f)
    return {"vocab_size": vocab_size, **counts}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="minddp prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    args = ap.parse_args(argv)
    try:
        info = prepare(args.input, args.out, args.tokenizer, args.vocab_size, args.val_fraction)
    except PrepareError as e:
        raise SystemExit(f"minddp.tools.prepare: error: {e}") from None
    print(f"wrote {args.out}: {info['train']} train and {info['val']} val tokens, "
          f"vocab {info['vocab_size']}; train with: python train.py data=tokens data.dir={args.out}")


if __name__ == "__main__":
    main()
