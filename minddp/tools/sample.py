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
Reading a run's newest readable checkpoint (`read_checkpoint`, `load`) is `minddp export`'s too;
the sampling loop is the model's (minddp.model.gpt.generate).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from ..errors import ConfigError
from ..model.build import build_model
from ..model.gpt import generate
from ..train.checkpoint import all_checkpoints, is_checkpoint_folder
from ..train.checkpoint import load as load_checkpoint
from ..train.checkpoint.files import ZIP_MAGIC
from ..train.data.tokens import read_meta
from .arguments import tool_parser

KNOWN_VOCABS = {50_257: "GPT-2", 50_304: "GPT-2 (padded)", 128_256: "llama-3"}


class SampleError(ValueError):
    """The run or its data cannot be used as given: exit code 2, naming the file."""


class Codec:
    """encode(str) -> ids, decode(ids) -> str, for the tokenizer a run trained with."""

    def __init__(self, encode, decode, name: str, size: int):
        self.encode, self.decode, self.name, self.size = encode, decode, name, size  # size: ids 0..size-1

    @classmethod
    def bytes(cls) -> "Codec":
        return cls(lambda s: list(s.encode()), lambda ids: bytes(ids).decode("utf-8", errors="replace"),
                   "bytes", 256)

    @classmethod
    def for_folder(cls, folder: Path) -> "Codec | None":
        """The codec of a token folder's tokenizer.json or meta.pkl; None if it has neither."""
        tok_file = folder / "tokenizer.json"
        if tok_file.is_file():
            return cls._from_tokenizer_json(tok_file)
        try:
            meta = read_meta(folder)
        except ConfigError as e:
            raise SampleError(str(e)) from None
        if "stoi" in meta and "itos" in meta:  # nanoGPT's character-level datasets
            stoi = meta["stoi"]
            itos = meta["itos"]  # a dict, or a list (both load in the trainer)
            itos = dict(enumerate(itos)) if isinstance(itos, list) else itos
            return cls(lambda s: [stoi[c] for c in s if c in stoi],
                       lambda ids: "".join(itos.get(i, "\ufffd") for i in ids), "chars (meta.pkl)",
                       max(itos, default=-1) + 1)
        if meta.get("tokenizer") == "bytes":
            return cls.bytes()
        return None

    @classmethod
    def _from_tokenizer_json(cls, path: Path) -> "Codec":
        try:
            spec = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise SampleError(f"{path} is not JSON ({e}): re-run minddp prepare, or remove it") from None
        if isinstance(spec, dict) and spec.get("type") == "bytes":
            return cls.bytes()
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception on a bad file
            raise SampleError(f"{path} is neither minddp's bytes marker nor a Hugging Face tokenizers "
                              f"file ({e})") from None
        return cls(lambda s: tok.encode(s).ids, lambda ids: tok.decode(ids), "bpe (tokenizer.json)",
                   tok.get_vocab_size())


def data_folder(data_cfg: dict, run_dir: Path, override: str | None) -> Path:
    """The folder the run trained on: --data, else data.dir as saved (absolute since minddp
    records it so; an older run's relative one is tried from here and above the run dir)."""
    if override:
        if not Path(override).is_dir():
            raise SampleError(f"--data {override} is not a folder")
        return Path(override)
    saved = Path(data_cfg["dir"])
    bases = [Path.cwd()] if saved.is_absolute() else [Path.cwd(), run_dir, *run_dir.parents]
    for base in bases:
        if (base / saved).is_dir():
            return base / saved
    where = "" if saved.is_absolute() else f" (tried from {Path.cwd()} and from {run_dir} upwards)"
    raise SampleError(f"the data folder this run trained on, {str(saved)!r} (data.dir in its saved config), "
                      f"does not exist{where}: pass --data DIR where its tokenizer.json or meta.pkl now is")


def codec_for(cfg: dict, run_dir: Path, override: str | None) -> tuple[Codec | None, str]:
    """(codec or None, a note for stderr when the ids cannot become text)."""
    if cfg["data"].get("name") != "tokens":
        return Codec.bytes(), ""
    folder = data_folder(cfg["data"], run_dir, override)
    codec = Codec.for_folder(folder)
    if codec is not None:
        return codec, ""
    vocab = cfg["model"].get("vocab_size")
    kind = f"{KNOWN_VOCABS[vocab]} token ids" if vocab in KNOWN_VOCABS else f"token ids (vocabulary {vocab})"
    return None, (f"minddp sample: {folder / 'tokenizer.json'} and a meta.pkl with itos are missing, so "
                  f"these {kind} cannot be turned into text; printing the ids. Put the tokenizer's "
                  "tokenizer.json there (GPT-2's: the Hugging Face Hub's gpt2/tokenizer.json) to see text")


def not_torch_save(path: Path) -> str | None:
    """Why a file cannot be a minddp checkpoint, before torch reads it: for any other file (a
    README, an older torch's pickle) torch's refusal advises retrying with weights_only=False,
    which would let the file run code. None for a folder or a zip archive (torch names what is
    wrong inside one)."""
    try:
        with open(path, "rb") as f:
            if f.read(len(ZIP_MAGIC)) == ZIP_MAGIC:
                return None
    except OSError:  # a folder, or a read error that load_checkpoint reports as such
        return None
    if path.name.startswith("ckpt_") and path.suffix == ".pt":  # named as the trainer names its files
        return f"checkpoint {path} is unreadable (truncated or corrupt): not a file torch.save wrote"
    return (f"{path} is not a minddp checkpoint (torch.save did not write it): give a run directory, or "
            "one of its checkpoints/ckpt_<step>.pt files or ckpt_<step> folders")


def read_checkpoint(target: Path, warn=None) -> tuple[Path, dict]:
    """A checkpoint file, or a run directory's newest readable one: a corrupt newer file is
    named to `warn` and the previous one used (generating changes nothing on disk)."""
    if target.is_file() or is_checkpoint_folder(target):
        candidates = [target]
    elif target.is_dir():
        candidates = all_checkpoints(target)
    else:
        raise SampleError(f"{target} does not exist: give a run directory or a checkpoint (a .pt file "
                          "or a ckpt_<step> folder)")
    if not candidates:
        raise SampleError(f"no checkpoint under {target}/checkpoints (a run directory or a checkpoint)")
    problems = []
    for path in candidates:
        try:
            if (why := not_torch_save(path)) is not None:
                raise ConfigError(why)
            return path, load_checkpoint(path, "cpu")
        except (ConfigError, OSError) as e:  # corrupt, refused or unreadable
            problems.append(str(e).splitlines()[0])
            if len(candidates) > 1 and warn is not None:
                warn(f"{problems[-1]}; trying the previous checkpoint")
    raise SampleError(problems[0] if len(candidates) == 1 else
                      f"none of the {len(candidates)} checkpoints under {target}/checkpoints can be read")


def load(target, warn=None) -> tuple[torch.nn.Module, dict, Path]:
    """The model of a run directory's newest readable checkpoint (or of one checkpoint file),
    its config and its run directory."""
    path, state = read_checkpoint(Path(target), warn)
    cfg = state.get("config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise SampleError(f"{path} has no saved config (written by an older minddp)")
    try:
        weights = state["model"]
        vocab = next(v.shape[0] for k, v in weights.items() if k in ("tok_emb.weight", "emb.weight"))
        model = build_model(_Cfg(cfg["model"]), vocab)
        model.load_state_dict(weights)
    except (StopIteration, KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        why = str(e).splitlines()[0][:160] if str(e) else "no embedding"
        raise SampleError(f"{path}: its weights do not fit the model its config describes "
                          f"({type(e).__name__}: {why})") from None
    cfg["model"]["vocab_size"] = vocab  # the embedding's, whatever the saved config says
    cfg["data_info"] = state.get("data") if isinstance(state.get("data"), dict) else {}  # what it trained on
    return model.eval(), cfg, path.parent.parent


def check_pairing(codec: Codec, cfg: dict, folder: str) -> str:
    """Before generating: the tokenizer must be the one the model trained with. Refused (one
    line) when it has ids the model lacks, or a vocabulary other than the one the run read
    from its data (a folder re-prepared with another tokenizer since); a model vocabulary
    padded past the tokenizer's (model.vocab_size=512 on bytes, GPT-2's 50304) samples only
    ids the tokenizer can decode: returns that note, else ''."""
    model_vocab, trained = cfg["model"]["vocab_size"], cfg.get("data_info") or {}
    fix = f"pass --data with the folder it trained on ({folder} now holds another tokenizer?)"
    if codec.size > model_vocab:
        raise SampleError(f"the tokenizer ({codec.name}) has {codec.size} ids, the model only {model_vocab}: "
                          f"not the tokenizer it trained with; {fix}")
    source, data_vocab = trained.get("vocab_source"), trained.get("vocab_size")
    if source and source != "model.vocab_size" and data_vocab not in (None, codec.size):
        raise SampleError(f"the tokenizer ({codec.name}) has {codec.size} ids, the run trained on a "
                          f"vocabulary of {data_vocab} ({source}); {fix}")
    if codec.size < model_vocab:
        return f"sampling only the tokenizer's {codec.size} ids of the model's {model_vocab}"
    return ""


class _Cfg(dict):
    """A dict that reads like the OmegaConf node build_model expects (m.name and m[key])."""

    __getattr__ = dict.__getitem__


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
