"""Generate text from a trained checkpoint: `minddp sample RUN_DIR --prompt "def "`.

    minddp sample outputs/2026-11-30/12-00-00 --prompt "import " --tokens 200
    minddp sample path/to/ckpt_00000200.pt --prompt "ROMEO:" --temperature 0.8 --top-k 40
    minddp sample outputs/gpt2-run --prompt-ids 50256 --data /new/place/of/the/shards

Takes a run directory (its newest checkpoint) or a checkpoint file. The model comes from
the config saved in the checkpoint; the tokenizer from the data folder it trained on
(data.dir as saved, absolute; --data overrides it), the first of:
  tokenizer.json  {"type": "bytes", "vocab_size": 256}: ids are raw bytes (minddp prepare
                  --tokenizer bytes); anything else is a Hugging Face `tokenizers` file
                  (minddp prepare --tokenizer bpe writes one; GPT-2's from the Hub works too)
  meta.pkl        nanoGPT's dict: vocab_size, and itos/stoi for character-level data
and raw bytes for data=text. Without any of them (llm.c's GPT-2 shards come without one)
the ids themselves are printed, with a note saying which file would turn them into text.
"""

from __future__ import annotations

import math
import sys

import torch

from ..errors import ConfigError
from ..train.generate import Codec, SampleError, check_pairing, codec_for, generate, load
from .arguments import tool_parser


def check_args(args) -> None:
    """Settings that cannot work, before the checkpoint is read."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise SampleError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if args.top_k < 0:
        raise SampleError(f"--top-k must be >= 0 (0: off), got {args.top_k}")
    if args.tokens < 0:
        raise SampleError(f"--tokens must be >= 0, got {args.tokens}")


def prompt_ids(args, codec: Codec | None, cfg: dict) -> list[int]:
    vocab = cfg["model"]["vocab_size"]
    if args.prompt_ids is not None:
        try:
            ids = [int(i) for i in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise SampleError(f"--prompt-ids {args.prompt_ids!r}: give integer token ids, e.g. '50256' or "
                              "'1,2,3'") from None
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise SampleError(f"--prompt-ids: {bad[0]} is outside this model's vocabulary "
                              f"(ids 0 to {vocab - 1})")
        return ids
    if codec is not None:
        return codec.encode(args.prompt)
    if args.prompt != "\n":
        raise SampleError("--prompt needs a tokenizer to become ids, and this run's data has none: "
                          "give --prompt-ids instead")
    vocab = cfg["model"].get("vocab_size")
    return [50_256] if vocab in (50_257, 50_304) else [0]  # GPT-2's <|endoftext|>


def warn(message: str) -> None:
    print(f"minddp sample: warning: {message}", file=sys.stderr)


def main(argv=None) -> None:
    ap = tool_parser("sample", __doc__)
    ap.add_argument("target", help="a run directory or a checkpoint file")
    ap.add_argument("--prompt", default="\n", help="text to continue, encoded with the run's tokenizer "
                    "(default: a newline)")
    ap.add_argument("--prompt-ids", default=None, help="the prompt as token ids: '50256' or '1,2,3'")
    ap.add_argument("--data", default=None, help="the token folder, if it moved since training")
    ap.add_argument("--tokens", type=int, default=200,
                    help="how many tokens to generate (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="softmax temperature: lower is more predictable (default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=40,
                    help="sample among the k likeliest tokens; 0: all (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1337, help="random seed, for the same text again "
                    "(default: %(default)s)")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    try:
        check_args(args)
        print(f"minddp sample: loading the model from {args.target} ...", file=sys.stderr, flush=True)
        model, cfg, run_dir = load(args.target, warn)
        codec, note = codec_for(cfg, run_dir, args.data)
        pairing = check_pairing(codec, cfg, args.data or cfg["data"].get("dir")) if codec else ""
        ids = prompt_ids(args, codec, cfg)
    except (SampleError, ConfigError) as e:  # ConfigError: a checkpoint that cannot be used
        print(f"minddp sample: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"minddp sample: generating {args.tokens} tokens ({sum(p.numel() for p in model.parameters()):,} "
          "parameters, cpu) ...", file=sys.stderr, flush=True)
    if pairing:
        print(f"minddp sample: {pairing}", file=sys.stderr)
    out = generate(model, ids, args.tokens, args.temperature, args.top_k, cfg["model"]["block_size"],
                   codec.size if codec else None)
    if codec is None:
        print(note, file=sys.stderr)
        print(" ".join(map(str, ids + out)))
    else:
        print((args.prompt if args.prompt_ids is None else codec.decode(ids)) + codec.decode(out))


if __name__ == "__main__":
    main()
