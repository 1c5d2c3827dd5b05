"""Checkpoints: written atomically by rank 0, read by every rank.

A checkpoint is one file `ckpt_<step>.pt` under `<run dir>/checkpoints/`,
written to a temporary name, flushed to disk, then renamed into place, so a
crash mid-write never leaves a truncated checkpoint where `latest()` finds it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

_NAME = re.compile(r"ckpt_(\d+)\.pt$")


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir, step: int, state: dict) -> Path:
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"ckpt_{step:08d}.pt"
    tmp = d / f".ckpt_{step:08d}.pt.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)  # atomic on POSIX
    return final


def latest(run_dir) -> Path | None:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def load(path, device) -> dict:
    return torch.load(path, map_location=device, weights_only=False)
