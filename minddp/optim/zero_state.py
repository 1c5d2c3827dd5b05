"""ZeRO-1's checkpoints: the sharded optimizer state as the unsharded optimizer's state dict
(full per-parameter tensors under torch's indices), and back into this rank's shards. So a
checkpoint loads with or without sharding, at any number of ranks.

`pieces` is the same state without the gather: each rank's own parts of every flattened
tensor (`Piece`), for checkpoints where every rank writes what it owns (minddp.train.checkpoint's
folder format joins them into full tensors on load).

A shard is a list of `zero.Segment`s: the part of one parameter that lies in this rank's slice
of one bucket. `group_params` lists the engine's parameter indices per param group, in the
order the unsharded optimizer numbers them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _compat


def unsharded(ddp, optim, segments, group_params) -> dict:
    """The unsharded optimizer's state dict, gathered from every rank: a collective."""
    keys, step = state_keys(optim, ddp.process_group)
    full = {key: gather(ddp, optim, segments, key) for key in keys}
    order = [i for ids in group_params for i in ids]
    state = {}
    if full or step is not None:
        for pos, i in enumerate(order):
            p = ddp.params[i]
            state[pos] = {key: full[key][i].view_as(p).clone() for key in full}
            if step is not None:
                state[pos]["step"] = step.clone()
    return {"state": state, "param_groups": _groups(optim, group_params)}


def _groups(optim, group_params) -> list[dict]:
    """The unsharded optimizer's param_groups: its options, parameters numbered in group order."""
    groups, pos = [], 0
    for g, ids in zip(optim.param_groups, group_params):
        options = {k: v for k, v in g.items() if k != "params"}
        groups.append({**options, "params": list(range(pos, pos + len(ids)))})
        pos += len(ids)
    return groups


@dataclass
class Piece:
    """This rank's part `[lo, lo + tensor.numel())` of a tensor of `shape`, flattened;
    `tensor` None where this rank holds none of it."""

    shape: tuple
    lo: int
    tensor: torch.Tensor | None


def pieces(ddp, optim, segments, group_params) -> dict:
    """`unsharded`'s state dict with each rank's own Pieces in place of the full tensors: no
    gather, no copy. One small collective (the agreed state keys). A parameter has at most one
    segment here: it lies in one bucket, and this rank's shard of a bucket is contiguous."""
    keys, step = state_keys(optim, ddp.process_group)
    mine = {s.param: s for s in segments if s.tensor in optim.state}
    state = {}
    if keys or step is not None:
        for pos, i in enumerate(i for ids in group_params for i in ids):
            shape, s = tuple(ddp.params[i].shape), mine.get(i)
            state[pos] = {key: Piece(shape, s.lo if s else 0, optim.state[s.tensor][key] if s else None)
                          for key in keys}
            if step is not None:
                state[pos]["step"] = step.clone()
    return {"state": state, "param_groups": _groups(optim, group_params)}


def state_keys(optim, group) -> tuple[list[str], torch.Tensor | None]:
    """The tensor state keys and the step every rank agrees on (a rank may hold no segment yet)."""
    mine = next((st for st in optim.state.values() if st), {})
    tensors = sorted(k for k, v in mine.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
    step = mine.get("step")
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (tensors, None if step is None else step.cpu()), group=group)
    return max(everyone, key=lambda e: len(e[0]))


def gather(ddp, optim, segments, key: str) -> dict[int, torch.Tensor]:
    """{engine parameter index: flat full state tensor} for one state key, bucket by bucket."""
    out = {}
    for b, bucket in enumerate(ddp.layout.buckets):
        lo, hi = ddp.layout.shard_range(b)
        mine = torch.zeros(hi - lo, dtype=torch.float32, device=bucket.buffer.device)
        for s in segments:
            if s.bucket == b and s.tensor in optim.state:
                off = bucket.offsets[bucket.param_ids.index(s.param)]
                mine[off + s.lo - lo: off + s.hi - lo] = optim.state[s.tensor][key].float()
        whole = torch.empty(bucket.buffer.numel(), dtype=torch.float32, device=mine.device)
        _compat.all_gather_single(whole, mine, group=ddp.process_group)
        for k, i in enumerate(bucket.param_ids):
            out[i] = whole[bucket.offsets[k]: bucket.offsets[k] + bucket.numels[k]]
    return out


def load_shards(optim, sd: dict, segments, group_params) -> None:
    """This rank's slices of an unsharded state dict, as the inner optimizer's state."""
    pos_of = {i: pos for pos, i in enumerate(i for ids in group_params for i in ids)}
    optim.state.clear()
    for s in segments:
        saved = sd["state"].get(pos_of[s.param]) or sd["state"].get(str(pos_of[s.param]))
        if not saved:
            continue
        st = {}
        for key, v in saved.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                st[key] = v.flatten()[s.lo:s.hi].to(s.tensor.device, s.tensor.dtype).clone()
            else:
                st[key] = v.clone().to(s.tensor.device) if isinstance(v, torch.Tensor) else v
        optim.state[s.tensor] = st


def positions(group_params) -> dict[int, int]:
    """{engine parameter index: its position in the unsharded state dict}."""
    return {i: pos for pos, i in enumerate(i for ids in group_params for i in ids)}


def install(optim, parts: dict, saved: dict, segments, group_params) -> None:
    """Loaded parts ({position: (lo, {key: flat part})}, cut as `segments` are) as the inner
    optimizer's state; the scalars (`step`) from `saved`, the unsharded state dict's."""
    pos_of = positions(group_params)
    optim.state.clear()
    for s in segments:
        pos = pos_of[s.param]
        if pos not in parts:
            continue
        lo, tensors = parts[pos]
        if lo != s.lo or any(t.numel() != s.hi - s.lo for t in tensors.values()):
            raise RuntimeError(f"a loaded optimizer part of parameter {pos} is not this rank's segment")
        st = {k: t.to(s.tensor.device, s.tensor.dtype) for k, t in tensors.items()}
        for k, v in (saved.get(pos) or {}).items():
            if k not in st:
                st[k] = v.clone().to(s.tensor.device) if isinstance(v, torch.Tensor) else v
        optim.state[s.tensor] = st


def fit_everywhere(parts: dict, saved: dict, segments, group_params, group) -> bool:
    """Whether on every rank the parts are exactly the segments it steps (of the parameters the
    state holds): one small all-reduce."""
    pos_of = positions(group_params)
    mine = {(pos_of[s.param], s.lo, s.hi - s.lo) for s in segments if pos_of[s.param] in saved}
    held = {(pos, lo, next(iter(ts.values())).numel()) for pos, (lo, ts) in parts.items() if ts}
    misfit = torch.tensor([float(mine != held)])
    dist.all_reduce(misfit, op=dist.ReduceOp.MAX, group=group)
    return not misfit.item()


def moved(ddp, parts: dict, saved: dict, segments, group_params) -> dict:
    """Parts cut by an earlier bucket layout, re-cut as `segments` (the layout now): bucket by
    bucket and key by key, each rank puts its parts into a zero buffer of the bucket and one
    all-reduce over its bytes (one writer per element: a copy, bit for bit) gives every rank
    the bucket, of which it keeps its segments. A collective; a bucket's buffer at a time, and
    `parts` is consumed bucket by bucket (the old parts freed as the new ones are made)."""
    pos_of = positions(group_params)
    keys = sorted({k for st in saved.values() for k, v in st.items()
                   if isinstance(v, torch.Tensor) and v.dim() > 0})
    dtypes = {k: next(v.dtype for st in saved.values() for kk, v in st.items() if kk == k) for k in keys}
    out: dict = {}
    for b, bucket in enumerate(ddp.layout.buckets):
        for key in keys:
            whole = torch.zeros(bucket.buffer.numel(), dtype=dtypes[key], device=bucket.buffer.device)
            for k, i in enumerate(bucket.param_ids):
                lo, tensors = parts.get(pos_of[i], (0, {}))
                if key in tensors:
                    off = bucket.offsets[k] + lo
                    whole[off:off + tensors[key].numel()] = tensors[key]
            dist.all_reduce(whole.view(torch.uint8), group=ddp.process_group)
            for s in segments:
                pos = pos_of[s.param]
                if s.bucket == b and key in (saved.get(pos) or {}):
                    off = bucket.offsets[bucket.param_ids.index(s.param)]
                    out.setdefault(pos, (s.lo, {}))[1][key] = whole[off + s.lo:off + s.hi].clone()
        for i in bucket.param_ids:
            parts.pop(pos_of[i], None)
    return out
