"""The tools' models: minddp.train's GPT built from perf's named presets (perf/workload.py)."""

from __future__ import annotations

import torch

from ..model.gpt import GPT, GPTConfig
from ..perf.workload import GPT_PRESETS, STUDY, STUDY_BATCH, compiled, lm_loss, overrides  # noqa: F401
from .arguments import positive_int


def bench_gpt(n_layer: int, n_embd: int) -> GPTConfig:
    """The study GPT resized by bench-ddp's and timeline's --n-layer/--n-embd."""
    return GPTConfig(**{**GPT_PRESETS[STUDY], "n_layer": n_layer, "n_embd": n_embd})


def add_gpt_size(ap) -> None:
    """bench-ddp's and timeline's --n-layer/--n-embd (bench_gpt)."""
    study = GPT_PRESETS[STUDY]
    ap.add_argument("--n-layer", type=positive_int, default=study["n_layer"])
    ap.add_argument("--n-embd", type=positive_int, default=study["n_embd"],
                    help=f"a multiple of the study GPT's {study['n_head']} heads")


def parse_gpt_size(ap, argv=None):
    """The arguments, --n-embd checked against the heads (before a model is built on every rank)."""
    args = ap.parse_args(argv)
    heads = GPT_PRESETS[STUDY]["n_head"]
    if args.n_embd % heads:
        ap.error(f"--n-embd {args.n_embd} is not a multiple of the study GPT's {heads} heads "
                 f"(e.g. {max(heads, args.n_embd - args.n_embd % heads)})")
    return args


def build(fields: dict, device, batch: int, seed: int = 0) -> tuple[GPT, torch.Tensor]:
    """(the GPT of these GPTConfig fields, a (batch, block + 1) batch of tokens), seeded alike on
    every rank."""
    cfg = GPTConfig(**fields)
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    return model, torch.randint(0, 256, (batch, cfg.block_size + 1), device=device)
