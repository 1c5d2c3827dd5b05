"""Integrity: a checksum of everything a checkpoint holds, its required layout, and a
fingerprint of the data files a run reads.

A checkpoint's `checksums` map every leaf (each tensor's dtype, shape and bytes; each number
and string) to its CRC-32, computed before `torch.save` and again after `torch.load`: one
flipped bit anywhere in what is loaded is a mismatch, hence a corrupt file (the trainer falls
back to the previous checkpoint). A flip in the zip's own bookkeeping either fails the load or
changes nothing that is loaded.

A data fingerprint is the files' names and sizes plus a hash of their bytes: whole files up
to 4 MiB, else the first and last 64 KiB and 16 blocks of 4 KiB spread over the file (cheap
on any size; an edit of the same length between two samples of a big file goes unseen).
"""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

import torch

KEY = "checksums"


def _leaves(obj, path: str = ""):
    """(path, buffers) of every leaf, in a deterministic order (dict keys sorted by repr)."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            if not (path == "" and k == KEY):
                yield from _leaves(obj[k], f"{path}/{k!r}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().reshape(-1)
        head = f"{t.dtype}|{tuple(obj.shape)}|".encode()
        yield path, [head, t.view(torch.uint8).cpu().numpy()] if t.numel() else [head]
    else:
        yield path, [f"{type(obj).__name__}|{obj!r}".encode()]


def _crc(buffers) -> int:
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return crc


def checksums(state: dict) -> dict[str, int]:
    return {path: _crc(parts) for path, parts in _leaves(state)}


def verify(state: dict) -> str | None:
    """None if the state's checksums match what it holds (or it has none: older minddp),
    else what differs."""
    saved = state.get(KEY)
    if saved is None:
        return None
    if not isinstance(saved, dict):
        return f"its {KEY} entry is a {type(saved).__name__}, not a dict"
    now = checksums(state)
    for path in sorted(saved.keys() | now.keys()):
        if saved.get(path) != now.get(path):
            what = ("missing" if path not in now else "not in the checksums" if path not in saved
                    else "checksum mismatch")
            return f"{what} at {path} (a flipped bit or a damaged copy)"
    return None


# what the trainer reads from a checkpoint, nested: a file missing one is corrupt
_LAYOUT = {"model": dict, "optimizer": dict, "scheduler": dict, "step": int, "rng": list}
_NESTED = (("optimizer", "state", dict), ("optimizer", "param_groups", list),
           ("scheduler", "last_epoch", int))


def layout_problem(state) -> str | None:
    if not isinstance(state, dict):
        return f"holds a {type(state).__name__}, not a minddp checkpoint"
    for key, kind in _LAYOUT.items():
        if not isinstance(state.get(key), kind):
            return f"is not a whole minddp checkpoint: {key!r} is missing or not a {kind.__name__}"
    for outer, key, kind in _NESTED:
        if not isinstance(state[outer].get(key), kind):
            return f"is not a whole minddp checkpoint: {outer}.{key} is missing or not a {kind.__name__}"
    if not state["rng"]:
        return "is not a whole minddp checkpoint: rng is empty"
    return None


def shape_problem(tensors: dict, expected: dict, what: str) -> str | None:
    """The first tensor whose name or shape is not what this model has."""
    if set(tensors) != set(expected):
        odd = sorted(set(tensors) ^ set(expected), key=str)[:3]
        return f"{what} holds other tensors than this model's ({odd} ...)"
    for name, shape in expected.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            return f"{what} {name}: shape {got}, this model's is {tuple(shape)}"
    return None


# ----------------------------------------------------------------- data files
WHOLE, EDGE, BLOCK, SAMPLES = 4 << 20, 64 << 10, 4 << 10, 16


def _sample_offsets(size: int) -> list[tuple[int, int]]:
    if size <= WHOLE:
        return [(0, size)]
    step = (size - 2 * EDGE) // (SAMPLES + 1)
    return ([(0, EDGE)] + [(EDGE + k * step, BLOCK) for k in range(1, SAMPLES + 1)]
            + [(size - EDGE, EDGE)])


def fingerprint(paths) -> str:
    """A short hash of the files' names, sizes and sampled bytes (see the module's docstring)."""
    h = hashlib.sha1()
    for p in paths:
        size = os.path.getsize(p)
        h.update(f"{Path(p).name}|{size}\n".encode())
        with open(p, "rb") as f:
            for offset, n in _sample_offsets(size):
                f.seek(offset)
                h.update(f.read(n))
    return h.hexdigest()[:16]
