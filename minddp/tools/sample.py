"""Generate text from a trained checkpoint: `minddp sample RUN_DIR --prompt "def "`.

    minddp sample outputs/2026-11-30/12-00-00 --prompt "import " --tokens 200
    minddp sample path/to/ckpt_00000200.pt --prompt "ROMEO:" --temperature 0.8 --top-k 40

Takes a run directory (its newest checkpoint) or a checkpoint file. The model comes from
the config saved in the checkpoint; the tokenizer from the data it trained on: raw bytes
(data=text, or a folder prepared with --tokenizer bytes), the BPE `tokenizer.json` that
`minddp prepare` saved beside the token files, or nanoGPT's `meta.pkl` itos/stoi.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn import functional as F

from ..train import checkpoint
from ..train.tokens import read_meta


class Codec:
    """encode(str) -> ids, decode(ids) -> str, for the tokenizer a run trained with."""

    def __init__(self, encode, decode, name: str):
        self.encode, self.decode, self.name = encode, decode, name

    @classmethod
    def for_data(cls, data_cfg: dict) -> "Codec":
        if data_cfg.get("name") == "tokens":
            folder = Path(data_cfg["dir"])
            tok_file = folder / "tokenizer.json"
            if tok_file.exists():
                spec = json.loads(tok_file.read_text())
                if spec.get("type") != "bytes":
                    from tokenizers import Tokenizer

                    tok = Tokenizer.from_file(str(tok_file))
                    return cls(lambda s: tok.encode(s).ids, lambda ids: tok.decode(ids), "bpe")
            else:
                meta = read_meta(folder)
                if "stoi" in meta and "itos" in meta:  # nanoGPT's character-level datasets
                    stoi, itos = meta["stoi"], meta["itos"]
                    return cls(lambda s: [stoi[c] for c in s if c in stoi],
                               lambda ids: "".join(itos[i] for i in ids), "chars (meta.pkl)")
                raise SystemExit(f"minddp.tools.sample: no tokenizer.json or meta.pkl itos in {folder}: "
                                 "cannot turn text into these token ids")
        return cls(lambda s: list(s.encode()),
                   lambda ids: bytes(ids).decode("utf-8", errors="replace"), "bytes")


def load(target) -> tuple[torch.nn.Module, dict]:
    """The model of a run directory's newest checkpoint (or of one checkpoint file), and its config."""
    from ..train.trainer import build_model

    target = Path(target)
    path = target if target.is_file() else checkpoint.latest(target)
    if path is None:
        raise SystemExit(f"minddp.tools.sample: no checkpoint under {target}/checkpoints")
    state = checkpoint.load(path, "cpu")
    if "config" not in state:
        raise SystemExit(f"minddp.tools.sample: {path} has no saved config (written by an older minddp)")
    cfg = state["config"]
    weights = state["model"]
    vocab = next(v.shape[0] for k, v in weights.items() if k in ("tok_emb.weight", "emb.weight"))
    model = build_model(_Cfg(cfg["model"]), vocab)
    model.load_state_dict(weights)
    return model.eval(), cfg


class _Cfg(dict):
    """A dict that reads like the OmegaConf node build_model expects (m.name and m[key])."""

    __getattr__ = dict.__getitem__


@torch.no_grad()
def generate(model, ids: list[int], tokens: int, temperature: float = 1.0, top_k: int | None = None,
             block_size: int = 128) -> list[int]:
    x = torch.tensor([ids or [0]], dtype=torch.long)
    for _ in range(tokens):
        logits = model(x[:, -block_size:])[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits[logits < kth] = -float("inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1)
        x = torch.cat([x, nxt], dim=1)
    return x[0, len(ids or [0]):].tolist()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="minddp sample", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="a run directory or a checkpoint file")
    ap.add_argument("--prompt", default="\n")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    model, cfg = load(args.target)
    codec = Codec.for_data(cfg["data"])
    out = generate(model, codec.encode(args.prompt), args.tokens, args.temperature, args.top_k,
                   cfg["model"]["block_size"])
    print(args.prompt + codec.decode(out))


if __name__ == "__main__":
    main()
