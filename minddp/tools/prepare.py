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
"""

from __future__ import annotations

import sys

from ..train.data.prepare import OUTPUTS, PrepareError, prepare  # noqa: F401 - OUTPUTS: what it writes
from .arguments import tool_parser


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
