"""Integrity: a checksum of everything a checkpoint holds, its required layout, and the
check that its tensors fit this model.

A checkpoint's `checksums` map every leaf (each tensor's dtype, shape and bytes; each number
and string) to its CRC-32, computed before `torch.save` and again after `torch.load`: one
flipped bit anywhere in what is loaded is a mismatch, hence a corrupt file (the trainer falls
back to the previous checkpoint). A flip in the zip's own bookkeeping either fails the load or
changes nothing that is loaded.

A tensor of the wrong shape under an unchanged model config is a corrupt file too
(`shape_problem`, `optimizer_problem`; choice.shape_check): the previous checkpoint is used
instead.
"""

from __future__ import annotations

import zlib

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


# what a checkpoint must hold (the one list, both formats): every reader (minddp sample, export)
# reads the first four; a resume reads all of them. A checkpoint missing one is corrupt.
REQUIRED = {"model": dict, "optimizer": dict, "scheduler": dict, "step": int,
            "rng": list, "optimizer.state": dict, "optimizer.param_groups": list, "scheduler.last_epoch": int}
READ_BY_ALL = 4


def layout_problem(state, resume: bool = True) -> str | None:
    """What a loaded state lacks of REQUIRED (`resume`: all of it; else what any reader needs)."""
    if not isinstance(state, dict):
        return f"holds a {type(state).__name__}, not a minddp checkpoint"
    for key, kind in list(REQUIRED.items())[:None if resume else READ_BY_ALL]:
        outer, _, inner = key.partition(".")
        value = state.get(outer)
        if inner and isinstance(value, dict):
            value = value.get(inner)
        if not isinstance(value, kind):
            return f"is not a minddp checkpoint: {key} is missing or not a {kind.__name__}"
    if resume and not state["rng"]:
        return "is not a minddp checkpoint: rng is empty"
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


def optimizer_problem(opt: dict, shapes: list) -> str | None:
    count = sum(len(g.get("params", ())) for g in opt["param_groups"] if isinstance(g, dict))
    if count != len(shapes):
        return f"the optimizer state is for {count} parameters, this model has {len(shapes)}"
    for idx, st in opt["state"].items():
        if not (isinstance(idx, int) and 0 <= idx < len(shapes) and isinstance(st, dict)):
            return f"the optimizer state has an entry {idx!r} that is no parameter's"
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(shapes[idx]):
                return (f"optimizer state {idx}.{key}: shape {tuple(v.shape)}, its parameter's is "
                        f"{tuple(shapes[idx])}")
    return None
