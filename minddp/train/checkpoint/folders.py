"""Folder checkpoints through torch.distributed.checkpoint (`train.ckpt_format=dcp`): every rank
writes what it owns, nothing is gathered onto one rank, and a load gives back the same state
dict as a single-file checkpoint (so every reader, check and dp size takes either).

    ckpt_<step>/
        state.pt          the small state (step, schedule, RNG, config, optimizer options), each
                          large tensor replaced by a reference {"__dcp__": name}; rank 0 writes it
        .metadata         DCP's index, and its files __<rank>_<n>.distcp: the model and optimizer
                          tensors, each written once (a replicated one by one rank, DCP's dedup)
        integrity.json    size and CRC-32 of every file above: written last, so a folder without it
                          is no checkpoint

A ZeRO-1 optimizer saves each rank's own part of every state tensor (`zero_state.Piece`, under
`<name>@<offset>`); a load joins the parts into the full tensor, which any dp size re-cuts.
A save writes into `.ckpt_<step>.tmp-<id>/` and rank 0 renames it once every rank's files are
written and checked: a crash leaves a temporary folder, removed at start-up, or put in place if
only its rename was missing (`recover`). Every rank reads back files the others wrote: the run
dir must be one every rank sees (a shared filesystem; node-local disks: ckpt_format=file).
Loading is `no_dist` (any rank, any process, no collective), weights_only for state.pt.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
import uuid
import warnings
import zlib
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...optim.zero_state import Piece
from ..io.atomic import atomic_write, fsync_dir

REF = "__dcp__"  # the key of a reference to a tensor held by DCP's files
STATE, INTEGRITY = "state.pt", "integrity.json"
LARGE = ("model", "optimizer")  # what goes through DCP; the rest of a checkpoint is small


class CorruptFolder(Exception):
    """A folder checkpoint whose files do not match its integrity.json, or do not join up."""


# ----------------------------------------------------------------------------- save
def split(state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the small state with references, {name: tensor} for DCP) of a checkpoint's state."""
    tensors: dict[str, torch.Tensor] = {}
    small = {k: (_split(v, k, tensors) if k in LARGE else v) for k, v in state.items()}
    return small, tensors


def _split(obj, name: str, tensors: dict):
    if isinstance(obj, Piece):
        if obj.tensor is not None:
            tensors[f"{name}@{obj.lo}"] = obj.tensor
        return {REF: name, "shape": list(obj.shape)}
    if isinstance(obj, torch.Tensor) and obj.dim() > 0:
        tensors[name] = obj
        return {REF: name}
    if isinstance(obj, dict):
        return {k: _split(v, f"{name}/{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, f"{name}[{i}]", tensors) for i, v in enumerate(obj))
    return obj


def begin(final: Path) -> Path:
    """Rank 0: a fresh temporary folder beside `final`, named for this save."""
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    return tmp


def write_small(tmp: Path, small: dict) -> None:
    with open(tmp / STATE, "wb") as f:
        torch.save(small, f)
        f.flush()
        os.fsync(f.fileno())


def stage(tensors: dict) -> dict:
    """A host copy of every tensor, for a write in the background: training goes on changing
    the originals. Every rank, before the write starts (its failure, e.g. out of host memory,
    is agreed on every rank before any rank starts writing)."""
    return {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}


def write_tensors(tmp: Path, tensors: dict) -> None:
    """Every rank, a collective: DCP plans which rank writes each tensor, then each writes
    its files (fsynced) and rank 0 the metadata, after every rank's writes."""
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not dist.is_initialized())


def write_in_background(tmp: Path, staged: dict, before=None) -> Future:
    """`write_tensors` of a staged copy on a thread of its own and a group of its own (on the
    training's group its collectives would interleave with the step's); a future of its end.
    torch's `dcp.async_save` does the same but stages inside the call, where one rank's
    failure would leave the others' writes waiting for it."""
    done: Future = Future()
    group = _background_group(dist.group.WORLD)

    def write() -> None:
        try:
            if before is not None:  # train.fault_sleep_in=checkpoint_write: a slow disk
                before()
            dcp.save(staged, storage_writer=dcp.FileSystemWriter(tmp), process_group=group)
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException: raised by result()
            done.set_exception(e)

    threading.Thread(target=write, name="minddp-checkpoint", daemon=True).start()
    return done


@functools.cache
def _background_group(world):
    """A gloo group for background writes, one per process group `world` (made at the first
    background write: a collective every rank reaches at the same step)."""
    return dist.new_group(backend="gloo")


def my_share(names: list[str], rank: int, world: int) -> list[str]:
    """The files this rank checksums: reading them back is split between the ranks."""
    return sorted(names)[rank::world]


def checksums(folder: Path, names: list[str]) -> dict[str, list[int]]:
    """{file: [size, CRC-32]}."""
    return {n: [(folder / n).stat().st_size, _crc(folder / n)] for n in names}


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc


def publish(tmp: Path, final: Path, sums: dict) -> None:
    """Rank 0, once every rank's files are written: integrity.json last, then the rename. The
    same step saved again (a resumed run) replaces the old folder; a crash between the renames
    leaves the new one whole (`recover` puts it in place)."""
    atomic_write(tmp / INTEGRITY, json.dumps(sums, indent=1, sort_keys=True))
    fsync_dir(tmp)
    aside = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    if final.exists():
        final.rename(aside)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def recover(tmp: Path) -> bool:
    """A temporary folder left by a crash: put in place if its save was whole (integrity.json
    written, only the rename missing) and nothing holds its name; True if it was."""
    final = tmp.with_name(tmp.name.split(".tmp-")[0].lstrip("."))
    if not (tmp / INTEGRITY).is_file() or final.exists():
        return False
    tmp.rename(final)
    fsync_dir(final.parent)
    return True


# ----------------------------------------------------------------------------- load
def is_folder(path) -> bool:
    """A folder not named like a file (`.pt`): loaded as a folder checkpoint, whatever its name."""
    return Path(path).is_dir() and not Path(path).name.endswith(".pt")


def load(folder: Path, device) -> dict:
    """The whole state of a folder checkpoint, as a single-file checkpoint holds it.
    CorruptFolder for a damaged folder; OSError (transient) for a failed read."""
    verify(folder)
    small = torch.load(folder / STATE, map_location=device, weights_only=True)
    if not isinstance(small, dict):
        raise CorruptFolder(f"{STATE} holds a {type(small).__name__}, not a dict")
    targets, wholes = _targets(folder, small, device)
    with warnings.catch_warnings():  # no_dist without a process group is what we mean
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(targets, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return {k: (_join(v, wholes) if k in LARGE else v) for k, v in small.items()}


def verify(folder: Path) -> None:
    try:
        sums = json.loads((folder / INTEGRITY).read_text())
    except FileNotFoundError:
        raise CorruptFolder(f"no {INTEGRITY}: an interrupted save, not a whole checkpoint") from None
    except ValueError as e:
        raise CorruptFolder(f"{INTEGRITY} does not parse: {e}") from None
    if STATE not in sums or ".metadata" not in sums:
        raise CorruptFolder(f"{INTEGRITY} lists neither {STATE} nor DCP's .metadata")
    for name, (size, crc) in sorted(sums.items()):
        try:
            got = (folder / name).stat().st_size
        except FileNotFoundError:
            raise CorruptFolder(f"{name} is missing") from None
        if got != size:
            raise CorruptFolder(f"{name} holds {got} bytes, {size} were written")
        if _crc(folder / name) != crc:
            raise CorruptFolder(f"checksum mismatch in {name} (a flipped bit or a damaged copy)")


def _targets(folder: Path, small: dict, device) -> tuple[dict, dict]:
    """DCP's load targets for every reference in `small`: a whole tensor per name, and a view
    into one per part of a joined tensor; ({DCP key: tensor}, {reference name: whole tensor})."""
    stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    targets, wholes = {}, {}
    for ref in (r for k in LARGE for r in _refs(small.get(k))):
        name = ref[REF]
        if "shape" not in ref:
            meta = _tensor_meta(stored, name)
            wholes[name] = targets[name] = torch.empty(meta.size, dtype=meta.properties.dtype,
                                                       device=device)
            continue
        parts = {int(k.rsplit("@", 1)[1]): k for k in stored if k.rsplit("@", 1)[0] == name}
        numel = torch.Size(ref["shape"]).numel()
        dtype = _tensor_meta(stored, next(iter(parts.values()))).properties.dtype if parts else None
        flat = torch.empty(numel, dtype=dtype, device=device)
        end = 0
        for lo in sorted(parts):
            n = _tensor_meta(stored, parts[lo]).size.numel()
            if lo != end or lo + n > numel:
                raise CorruptFolder(f"the parts of {name} do not join up at element {end} of {numel}")
            targets[parts[lo]], end = flat[lo:lo + n], lo + n
        if end != numel:
            raise CorruptFolder(f"the parts of {name} end at element {end} of {numel}")
        wholes[name] = flat.view(ref["shape"])
    return targets, wholes


def _tensor_meta(stored, name: str):
    meta = stored.get(name)
    if meta is None or not hasattr(meta, "size"):
        raise CorruptFolder(f"DCP's .metadata holds no tensor {name}")
    return meta


def _refs(obj):
    if isinstance(obj, dict):
        if REF in obj:
            yield obj
        else:
            for v in obj.values():
                yield from _refs(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _refs(v)


def _join(obj, wholes: dict):
    if isinstance(obj, dict):
        return wholes[obj[REF]] if REF in obj else {k: _join(v, wholes) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, wholes) for v in obj)
    return obj
