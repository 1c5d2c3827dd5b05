"""Text to token files: `minddp prepare INPUT --out DIR`.

    minddp prepare corpus.txt --out data/mine                      # bytes (vocab 256)
    minddp prepare texts/ --out data/mine --tokenizer bpe --vocab-size 4096

INPUT is a text file or a folder of them. Writes nanoGPT's layout, which `data=tokens
data.dir=DIR` trains on: headerless `train.bin` and `val.bin` (uint16 ids, uint32 past
65536), `meta.pkl` with `vocab_size`, and `tokenizer.json` for `minddp sample`.
`bpe` trains a byte-level BPE tokenizer with Hugging Face `tokenizers` on the train part,
offline. The last --val-fraction of the input's bytes goes to val.bin.

Safe to re-run on a folder a job is training from: everything is written to a temporary
folder beside DIR and renamed into place at the end, so a failed run leaves the old files
as they were, and a running job keeps reading its old (memory-mapped) files. Other files in
DIR (the input text, a script) are kept. A temporary folder left by a prepare that was killed
(kill -9, a power cut) is removed by the next prepare of the same DIR on that machine; a DIR
that is a symbolic link keeps pointing where it did (its target is what is replaced).
The input is streamed in 1 MB pieces, not lines: peak memory does not depend on line length
or corpus size.
Exit codes: 0 done, 2 bad arguments or input, 1 an operating-system error (disk full, permissions).

`prepare()` is the pipeline, the command line's last call: bad arguments or input are a
PrepareError, raised before anything is written.
"""

from __future__ import annotations

import glob
import json
import math
import os
import pickle
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..io.atomic import fsync_dir, umask
from ..train.data.sources import corpus_files
from .arguments import tool_parser

MAX_BPE_VOCAB = 1 << 20  # a BPE vocabulary past any in use (GPT-4's ~100k, Gemma's 256k)
BYTES_TOKENIZER = {"type": "bytes", "vocab_size": 256}  # minddp's marker: ids are the raw bytes
OUTPUTS = ("train.bin", "val.bin", "meta.pkl", "tokenizer.json")
CHUNK_BYTES = 1 << 20
BPE_PIECE = 1 << 16  # text per encode call or training item: `tokenizers` buffers 256 items


class PrepareError(ValueError):
    """Bad arguments or input: exit code 2."""


# ------------------------------------------------------------------ reading
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


def byte_chunks(files: list[Path], start: int = 0, stop: int | None = None, size: int = CHUNK_BYTES):
    """Bytes [start, stop) of the files read as one stream, in pieces of at most `size`."""
    pos = 0
    for f in files:
        n = f.stat().st_size
        lo, hi = max(start, pos), n + pos if stop is None else min(stop, n + pos)
        if lo < hi:
            with open(f, "rb") as fh:
                fh.seek(lo - pos)
                left = hi - lo
                while left > 0:
                    chunk = fh.read(min(size, left))
                    if not chunk:
                        break  # the file shrank while read
                    left -= len(chunk)
                    yield chunk
        pos += n


def counted(chunks, bar):
    for chunk in chunks:
        bar.update(len(chunk))
        yield chunk


def text_cut(buf: bytes) -> int:
    """Where to end a piece of text: before its last whitespace (a word, with its leading space,
    stays whole, as byte-level BPE pre-tokenises it), else at the last whole UTF-8 character."""
    ws = max(buf.rfind(c, 1) for c in (b" ", b"\n", b"\t", b"\r"))
    if ws > 0:
        return ws
    j = len(buf) - 1
    while j > 0 and j > len(buf) - 4 and buf[j] & 0xC0 == 0x80:  # continuation bytes
        j -= 1
    lead = buf[j] if buf else 0
    width = 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return len(buf) if j + width <= len(buf) else j


def text_pieces(chunks, limit: int = BPE_PIECE):
    """The byte stream as str pieces of about `limit` bytes, cut by text_cut (bounded memory)."""
    carry = b""
    for chunk in chunks:
        buf = carry + chunk
        while len(buf) >= limit:
            cut = text_cut(buf[:limit]) or limit
            yield buf[:cut].decode("utf-8", errors="replace")
            buf = buf[cut:]
        carry = buf
    if carry:
        yield carry.decode("utf-8", errors="replace")


# ------------------------------------------------------------------ tokenisers
def train_bpe(files: list[Path], stop: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with tqdm(total=stop, unit="B", unit_scale=True, desc="train BPE", disable=None) as bar:
        tok.train_from_iterator(text_pieces(counted(byte_chunks(files, 0, stop), bar)), trainer)
    return tok


def check_bpe_reach(vocab_size: int, train_bytes: int) -> None:
    """A vocabulary BPE can learn: each merge joins two tokens of the training text, so it makes at
    most one new token per byte; and at most MAX_BPE_VOCAB (the trainer reserves room for the
    whole request: 10**9 aborts the process, SIGABRT, leaving the temporary folder behind)."""
    most = min(MAX_BPE_VOCAB, 256 + train_bytes)
    if vocab_size > most:
        why = ("the most minddp prepare trains (GPT-4's is about 100k)" if most == MAX_BPE_VOCAB
               else f"BPE can learn from {train_bytes} bytes of training text (256 + one merge per byte)")
        raise PrepareError(f"--vocab-size {vocab_size} is more than {why}: give --vocab-size <= {most}")


def dtype_for(vocab_size: int) -> np.dtype:
    if vocab_size > 2**32:
        raise PrepareError(f"--vocab-size {vocab_size} does not fit uint32 token ids")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def encode_range(files, start: int, stop: int, out_file, encode, dtype, bar) -> int:
    """Bytes [start, stop) of the input, encoded and appended to out_file: its token count."""
    count = 0
    for piece in encode(counted(byte_chunks(files, start, stop), bar)):
        ids = np.asarray(piece, dtype=dtype)
        ids.tofile(out_file)
        count += len(ids)
    return count


def bytes_encoder(chunks):
    for chunk in chunks:
        yield np.frombuffer(chunk, dtype=np.uint8)


def bpe_encoder(tok):
    def encode(chunks):
        for piece in text_pieces(chunks):
            yield tok.encode(piece).ids
    return encode


# ------------------------------------------------------------------ checks before any work
def split_point(files, val_fraction: float, total: int, tokenizer: str) -> int:
    """The byte where val starts; an empty split is refused before anything is written."""
    if not (math.isfinite(val_fraction) and 0 < val_fraction < 1):
        raise PrepareError(f"--val-fraction must be strictly between 0 and 1, got {val_fraction}: "
                           "training needs a train and a val split")
    cut = total - int(total * val_fraction)
    if tokenizer == "bpe" and 0 < cut < total:  # not inside a word or a UTF-8 character
        window = b"".join(byte_chunks(files, max(0, cut - 4096), cut))
        cut = cut - len(window) + (text_cut(window) or len(window))
    if not 0 < cut < total:
        empty = "val" if cut >= total else "train"
        raise PrepareError(f"--val-fraction {val_fraction} of {total} bytes leaves {empty} empty: "
                           "use more text or another --val-fraction")
    return cut


def check_out(out: Path, input_path: Path) -> None:
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file, not a folder")
    above = next(p for p in out.absolute().parents if p.exists())
    if not above.is_dir():
        raise PrepareError(f"--out {out}: {above} is a file, not a folder")
    if input_path.is_dir() and (out.resolve() == input_path.resolve() or input_path.resolve() in
                                out.resolve().parents):
        raise PrepareError(f"--out {out} is inside the input folder {input_path}: the next run would read "
                           "its own output; choose a folder outside it")
    if out.is_dir():
        folders = [p.name for p in out.iterdir() if p.is_dir()]
        if folders:
            raise PrepareError(f"--out {out} holds folders ({', '.join(sorted(folders)[:3])}): it is "
                               "replaced as a whole, so give a folder that holds only files, or a new one")


def check_vocab(tokenizer: str, vocab_size: int | None) -> int:
    if tokenizer == "bytes":
        if vocab_size is not None:
            raise PrepareError(f"--vocab-size {vocab_size} does not apply to --tokenizer bytes (its "
                               "vocabulary is the 256 byte values): drop it, or use --tokenizer bpe")
        return 256
    if tokenizer != "bpe":
        raise PrepareError(f"--tokenizer must be bytes or bpe, got {tokenizer!r}")
    vocab_size = 4096 if vocab_size is None else vocab_size
    if vocab_size <= 256:
        raise PrepareError(f"--vocab-size {vocab_size}: byte-level BPE needs more than its 256 base tokens")
    dtype_for(vocab_size)
    return vocab_size


# ------------------------------------------------------------------ writing
def write_outputs(tmp: Path, files, cut: int, total: int, tokenizer: str, vocab_size: int) -> dict:
    if tokenizer == "bytes":
        encode = bytes_encoder
        (tmp / "tokenizer.json").write_text(json.dumps(BYTES_TOKENIZER))
    else:
        tok = train_bpe(files, cut, vocab_size)
        vocab_size = tok.get_vocab_size()
        tok.save(str(tmp / "tokenizer.json"))
        encode = bpe_encoder(tok)
    dtype, counts = dtype_for(vocab_size), {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="encode", disable=None) as bar:
        for split, (lo, hi) in (("train", (0, cut)), ("val", (cut, total))):
            with open(tmp / f"{split}.bin", "wb") as f:
                counts[split] = encode_range(files, lo, hi, f, encode, dtype, bar)
    with open(tmp / "meta.pkl", "wb") as f:  # a plain dict: readable without running code
        pickle.dump({"vocab_size": vocab_size, "tokenizer": tokenizer}, f)
    for name in OUTPUTS:  # on disk before the rename makes them the output
        with open(tmp / name, "rb+") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)
    return {"vocab_size": vocab_size, **counts}


def install(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place. The old one is renamed aside first and removed
    after: its files' inodes live on while a job has them open or memory-mapped. Files of
    the old folder that prepare does not write (the input text, a script) are hard-linked in."""
    if out.exists():
        for p in out.iterdir():
            if p.name not in OUTPUTS and p.is_file():
                try:
                    os.link(p, tmp / p.name)
                except OSError:  # a file system without hard links
                    shutil.copy2(p, tmp / p.name)
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=_temp_prefix(out, "old")))
        os.replace(out, old / out.name)
        try:
            os.replace(tmp, out)
        except OSError:
            os.replace(old / out.name, out)  # put the old folder back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def _temp_base(out: Path, kind: str) -> str:
    """The temporaries' names say whose they are (host, then process id), so a later prepare
    can tell a dead run's leftovers from a running one's."""
    return f".{out.name}.{kind}-{socket.gethostname()}-"


def _temp_prefix(out: Path, kind: str) -> str:
    return f"{_temp_base(out, kind)}{os.getpid()}-"


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Temporary folders of an earlier prepare of `out` on this host whose process is gone."""
    removed = []
    for kind in ("prepare", "old"):
        base = _temp_base(out, kind)
        for p in out.parent.glob(glob.escape(base) + "*"):
            pid = p.name[len(base):].split("-", 1)[0]
            if not pid.isdigit() or _alive(int(pid)) or not p.is_dir():
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            print(f"minddp prepare: removed {p}, left by a prepare that did not finish", file=sys.stderr)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def prepare(input_path, out, tokenizer: str = "bytes", vocab_size: int | None = None,
            val_fraction: float = 0.05) -> dict:
    input_path, out = Path(input_path), Path(out)
    if out.is_symlink():  # write through it: the link stays, its target folder is replaced
        out = Path(os.path.realpath(out))
    asked, vocab_size = vocab_size, check_vocab(tokenizer, vocab_size)
    files = input_files(input_path)
    total = sum(f.stat().st_size for f in files)
    cut = split_point(files, val_fraction, total, tokenizer)
    if tokenizer == "bpe" and asked is not None:  # the default (4096) of a smaller text: what it can learn
        check_bpe_reach(asked, cut)
    check_out(out, input_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=_temp_prefix(out, "prepare")))
    tmp.chmod(0o777 & ~umask())  # mkdtemp's 0700 would become the output folder's mode
    try:
        info = write_outputs(tmp, files, cut, total, tokenizer, vocab_size)
        install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; a failed run's files otherwise
    return info


def main(argv=None) -> None:
    ap = tool_parser("prepare", __doc__)
    ap.add_argument("input")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes")
    ap.add_argument("--vocab-size", type=int, default=None, help="bpe only (default 4096)")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    args = ap.parse_args(argv)
    try:
        info = prepare(args.input, args.out, args.tokenizer, args.vocab_size, args.val_fraction)
    except PrepareError as e:
        raise SystemExit(_fail(f"{e}", 2)) from None
    except OSError as e:  # disk full, permissions: the old output is untouched
        where = f": {e.filename}" if e.filename else ""
        raise SystemExit(_fail(f"{e.strerror or e}{where}; {args.out} is unchanged", 1)) from None
    print(f"wrote {args.out}: {info['train']} train and {info['val']} val tokens, "
          f"vocab {info['vocab_size']}; train with: python train.py data=tokens data.dir={args.out}")


def _fail(message: str, code: int) -> int:
    print(f"minddp prepare: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    main()
