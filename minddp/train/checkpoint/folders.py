"""The folder format (`train.ckpt_format=dcp`, the default) through torch.distributed.checkpoint:
every rank writes what it owns, nothing is gathered onto one rank, and a load gives back the
same state dict as a file (so every reader, check and dp size takes either). Its verbs, as the
file format's:

    FOLDER.save(run_dir, step, state)                 every rank; committed when it returns
    FOLDER.save_in_background(run_dir, step, state)   every rank; a BackgroundSave to commit()
    FOLDER.load(path, device)                         the whole state dict; CheckpointError when corrupt
    FOLDER.open(path, device)                         the small state, meta tensors for the large ones
    FOLDER.load_into(path, targets)                   every rank: its own parts, read in place
    FOLDER.leftovers(run_dir)                         what a crash left of a save

    ckpt_<step>/
        state.pt          the small state (step, schedule, RNG, config, optimizer options), each
                          large tensor replaced by a reference {"__dcp__": name}; rank 0 writes it
        .metadata         DCP's index, and its files __<rank>_<n>.distcp: the model and optimizer
                          tensors in their whole shapes, each rank's parts at their offsets
                          (sharded.Shards: tp slices, ZeRO-1 parts), each written once
        integrity.json    {"version": 2, "files": every file's size (and state.pt's and .metadata's
                          CRC-32), "chunks": [file, offset, length, CRC-32] of every stored item}:
                          written last, so a folder without it is no checkpoint

A save writes into `.ckpt_<step>.tmp-<id>/`; every item's CRC-32 is taken as DCP writes it
(sharded.SummingWriter: nothing is read back), then rank 0 writes integrity.json and renames the
folder. A crash leaves a temporary folder, removed at start-up, or put in place if only its
rename was missing. A resume reads, on each rank, only the stored items its own tensors overlap
(`load_into`: DCP's distributed load, any dp/tp/ZeRO-1 layout from any other), each checked
against its CRC-32 as read (sharded.CheckedReader); `load` reads everything (no_dist: any
process, no collective). state.pt is read weights_only, DCP's .metadata through
dcp_reader.SafeReader (a restricted unpickler: a planted folder runs no code). Every rank reads
files the others wrote: the run dir must be one every rank sees (a shared filesystem; node-local
disks: ckpt_format=file). Folders of minddp 0.6 (integrity.json of whole files, ZeRO-1 parts
under `<name>@<offset>`) are loaded whole, as before.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import json
import logging
import os
import shutil
import threading
import uuid
import warnings
import zlib
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...io.atomic import atomic_write, fsync_dir
from ...optim.zero_state import Piece
from ..safety.together import together
from . import store
from .dcp_reader import SafeReader, UnsafeIndex, read_index, to_torch_save
from .errors import (
    CheckpointError,
    CheckpointWriteError,
    DifferentModel,
    first_failure,
    is_transient,
    read_error,
    unreadable,
    write_error,
)
from .files import checked, on_rank0
from .sharded import (
    CheckedReader,
    CorruptChunk,
    LoadPlanner,
    ModelMismatch,
    SavePlanner,
    Shards,
    SummingWriter,
)

REF = "__dcp__"  # the key of a reference to a tensor held by DCP's files
STATE, INTEGRITY = "state.pt", "integrity.json"
LARGE = ("model", "optimizer", "rng")  # through DCP (each rank writes its own RNG state); the rest is small
_KINDS = (CheckpointWriteError,) * 2  # any failure of a save stops every rank as one
log = logging.getLogger("minddp")


class CorruptFolder(Exception):
    """A folder checkpoint whose files do not match its integrity.json, or do not join up."""


class FolderCheckpoints:
    name, suffix = "dcp", ""
    verified_by_save = True  # its commit stats every file; each item summed as written, fsynced by DCP

    def path(self, run_dir, step: int) -> Path:
        return store.checkpoint_dir(run_dir) / store.name_for(step)

    def owns(self, path) -> bool:
        """A folder not named like a file (`.pt`): a folder checkpoint, whatever its name."""
        return Path(path).is_dir() and not Path(path).name.endswith(".pt")

    # ------------------------------------------------------------------------- save
    def save(self, run_dir, step: int, state: dict) -> Path:
        """Every rank, at the same point: each writes its tensors, rank 0 the small state; then
        the commit. A failure anywhere raises CheckpointWriteError on every rank, the previous
        checkpoint intact."""
        saving = self._start(run_dir, step, state)
        with saving.cleaned_up_on_error():
            saving.writer = write_tensors(saving.tmp, saving.tensors)
        return saving.commit()

    def save_in_background(self, run_dir, step: int, state: dict, *, timeout_s: float = 1800.0,
                           before_write=None) -> BackgroundSave:
        """Every rank: a host copy of its tensors (agreed: one rank out of host memory stops every
        rank before any writes), then the write on a thread; commit() after the next step."""
        saving = self._start(run_dir, step, state)
        with saving.cleaned_up_on_error():
            staged, error = None, None
            try:
                staged = stage(saving.tensors)
            except Exception as e:  # noqa: BLE001 - out of host memory on one rank: every rank stops
                error = e
            together(error, what=saving.what, kinds=_KINDS)
            saving.tensors = None  # the originals go on training: only the copy is written
            saving.writing = write_in_background(saving.tmp, staged, timeout_s, before_write)
        return saving

    def _start(self, run_dir, step: int, state: dict) -> BackgroundSave:
        """Rank 0 makes the temporary folder and writes the small state into it (one collective)."""
        final = self.path(run_dir, step)
        small, tensors = split(state)
        what = f"save step {step}"
        tmp, small_sum = on_rank0(lambda: begin_with(final, small), final, what)
        return BackgroundSave(step, final, tmp, what, tensors, small_sum)

    # ------------------------------------------------------------------------- load
    def load(self, path, device) -> dict:
        """The whole state, as a file holds it. CheckpointError for a damaged folder,
        CheckpointReadError for a failed read (the folder may be fine)."""
        with _reading(Path(path)):
            state = load_folder(Path(path), device)
        return checked(path, state)

    def open(self, path, device) -> dict:
        """The state with each large tensor a meta tensor of its stored shape and dtype (nothing
        of it read: `load_into` reads each rank's part); its files' sizes and the small files'
        checksums checked. A folder of minddp 0.6 (no per-item checksums): the whole state."""
        path = Path(path)
        with _reading(path):
            state = open_folder(path, device)
        return checked(path, state)

    def load_into(self, path, targets: dict) -> int:
        """Every rank, a collective: DCP reads into `targets` ({name: Shards or tensor}, each
        rank's own part) only the stored items they overlap, each checked as read. Returns the
        bytes this rank read. CheckpointError on every rank if any rank's bytes are damaged."""
        path = Path(path)
        with _reading(path):
            return load_into(path, targets)

    def to_torch_file(self, path, out: Path) -> None:
        """One torch.save file of the whole checkpoint (minddp export): torch's own converter,
        reading `.metadata` without running code (dcp_reader.py)."""
        to_torch_save(path, out)

    # ------------------------------------------------------------------------- crashes
    def leftovers(self, run_dir) -> list[Path]:
        """Saves a crash interrupted (`.ckpt_<step>.tmp-<id>/`: put in place when only the rename
        was missing) and folders a same-step save set aside (`.ckpt_<step>.old-<id>/`: removed, or
        put back where the save that replaced them did not finish)."""
        d = store.checkpoint_dir(run_dir)
        if not d.is_dir():
            return []
        removed = []
        for p in sorted(d.glob(".ckpt_*.tmp-*")):
            if recover(p):
                log.warning(f"{p} was a whole checkpoint whose rename a crash interrupted: put in place")
            else:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        for p in sorted(d.glob(".ckpt_*.old-*")):
            if put_back(p):
                log.warning(f"{p}, set aside by a same-step save that did not finish: put back")
            else:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed


FOLDER = FolderCheckpoints()


# ----------------------------------------------------------------------------- one save
class BackgroundSave:
    """A folder checkpoint on its way: its temporary folder, its tensors until written, and the
    future of a background write. `commit()` (every rank, at one point) or `end()` (a way out)."""

    def __init__(self, step: int, final: Path, tmp: Path, what: str, tensors: dict, small_sum=None):
        self.step, self.final, self.tmp, self.what = step, final, tmp, what
        self.tensors, self.small_sum = tensors, small_sum
        self.writing: concurrent.futures.Future | None = None
        self.writer: SummingWriter | None = None  # DCP's, done: on rank 0 every item's checksum

    def commit(self) -> Path:
        """Every rank: the tensors written, then rank 0's integrity.json (the checksums taken as
        the bytes were written: nothing is read back) and rename; one collective. A failure
        anywhere stops every rank and leaves the previous checkpoint as it was."""
        with self.cleaned_up_on_error():
            if self.writing is not None:
                self.writer = self.writing.result()
                self.writing = None
            on_rank0(lambda: publish(self.tmp, self.final, self.integrity()), self.final, self.what)
        return self.final

    def integrity(self) -> dict:
        """Rank 0, once DCP's save returned: integrity.json's content. Every file is checked to
        be there, of its size (a stat): a rank whose files rank 0 cannot see wrote to another disk."""
        files = {STATE: list(self.small_sum), ".metadata": list(self.writer.metadata_sum)}
        for name, offset, length, _ in self.writer.chunks:
            files[name] = [max(files.get(name, [0])[0], offset + length), None]
        for name, (size, _) in files.items():
            try:
                got = (self.tmp / name).stat().st_size
            except FileNotFoundError:
                raise CheckpointWriteError(
                    f"rank 0 cannot see {name}, which another rank wrote: train.ckpt_format=dcp needs a run "
                    "dir every rank sees (a shared filesystem); with node-local disks use "
                    "train.ckpt_format=file") from None
            if got != size:
                raise CheckpointWriteError(f"{self.tmp / name} holds {got} bytes, {size} were written")
        return {"version": 2, "files": files, "chunks": self.writer.chunks}

    def end(self, timeout_s: float) -> str | None:
        """A way out other than the commit (an error, on any rank, maybe on one alone): no
        collective on the training's groups. Each rank waits for its own write (DCP's collectives
        run on the write's own group, between the write threads); then rank 0 commits the folder
        alone if its DCP save completed, which means every rank's did (its checksums came with
        it), else removes it. Returns rank 0's closing line (None on the others)."""
        said = f"the checkpoint of step {self.step}, written in the background when the run stopped"
        rank0 = dist.get_rank() == 0
        # twice the collectives' own timeout: a write blocked in one (a peer stuck) fails there
        # first and is removed, rather than racing this wait and being left to the next start
        wait_s = 2 * timeout_s
        try:
            if self.writing is not None:
                self.writer = self.writing.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            return (f"{said}: still being written after {wait_s:.0f} s (2 x train.timeout_s), left as "
                    f"{self.tmp.name}, which the next start removes") if rank0 else None
        except BaseException as e:  # noqa: BLE001 - its failure is why it is removed, said below
            return self._removed(said, e) if rank0 else None
        if not rank0:
            return None
        try:
            publish(self.tmp, self.final, self.integrity())
        except Exception as e:  # noqa: BLE001 - a folder that cannot be committed is removed
            return self._removed(said, e)
        return f"{said}: completed and committed as {self.final}"

    def _removed(self, said: str, e: BaseException) -> str:
        shutil.rmtree(self.tmp, ignore_errors=True)
        if isinstance(e, dcp.CheckpointException):
            e = first_failure(e)
        prev = store.latest(self.final.parent.parent)
        return f"{said}: removed ({type(e).__name__}: {e}); the newest checkpoint is {prev or 'none'}"

    @contextmanager
    def cleaned_up_on_error(self):
        """DCP's failures as a CheckpointWriteError (DCP raises them on every rank); rank 0
        removes the temporary folder of a save that failed."""
        try:
            try:
                yield
            except dcp.CheckpointException as e:
                raise write_error(self.final, first_failure(e)) from None
        except BaseException:
            if dist.get_rank() == 0 and self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise


def different_model(path, e: ModelMismatch) -> DifferentModel:
    return DifferentModel(f"checkpoint {path} was written by a different model: {e}. Use the model config it "
                          "was trained with, or train.resume=none")


@contextmanager
def _reading(path: Path):
    """A read's failures as a format's: CheckpointError (corrupt: an older one may do),
    CheckpointReadError (a failed read: the folder may be fine), memory errors as they are."""
    damaged = (CorruptFolder, CorruptChunk, UnsafeIndex)
    try:
        yield
    except ModelMismatch as e:
        raise different_model(path, e) from None
    except damaged as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from None
    except OSError as e:
        raise read_error(path, e) from e
    except dcp.CheckpointException as e:  # DCP's own: the reads' failures, per rank
        cause = first_failure(e)
        if isinstance(cause, ModelMismatch):
            raise different_model(path, cause) from None
        if isinstance(cause, damaged):
            raise CheckpointError(f"checkpoint {path} is corrupt: {cause}") from None
        if isinstance(cause, OSError):
            raise read_error(path, cause) from e
        raise unreadable(path, cause) from None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - state.pt that does not parse, memory: as a file's
        if is_transient(e):
            raise
        raise unreadable(path, e) from None


# ----------------------------------------------------------------------------- writing
def split(state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the small state with references, {name: tensor} for DCP) of a checkpoint's state."""
    tensors: dict[str, torch.Tensor] = {}
    small = {k: (_split(v, k, tensors) if k in LARGE else v) for k, v in state.items()}
    return small, tensors


def _split(obj, name: str, tensors: dict):
    if isinstance(obj, Piece):  # one rank's part of a flattened tensor, placed in the whole
        if obj.tensor is not None:
            tensors[name] = Shards.of_flat_range(obj.shape, obj.lo, obj.tensor)
        return {REF: name}
    if isinstance(obj, Shards) or (isinstance(obj, torch.Tensor) and obj.dim() > 0):
        tensors[name] = obj
        return {REF: name}
    if isinstance(obj, dict):
        return {k: _split(v, f"{name}/{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, f"{name}[{i}]", tensors) for i, v in enumerate(obj))
    return obj


def begin_with(final: Path, small: dict) -> tuple[Path, tuple[int, int]]:
    """Rank 0: a fresh temporary folder beside `final`, named for this save, with the small state
    in it; (folder, its size and CRC-32)."""
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        return tmp, write_small(tmp, small)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_small(tmp: Path, small: dict) -> tuple[int, int]:
    """state.pt, fsynced; (its size, its CRC-32), taken from the bytes written."""
    buf = io.BytesIO()
    torch.save(small, buf)
    data = buf.getbuffer()
    with open(tmp / STATE, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), zlib.crc32(data)


def stage(tensors: dict) -> dict:
    """A host copy of every tensor, for a write in the background: training goes on changing
    the originals (on a GPU, a device-to-host copy)."""
    def copy(t):
        return t.detach().to("cpu", copy=True)
    return {k: (Shards(t.size, [(o, copy(c)) for o, c in t.chunks]) if isinstance(t, Shards) else copy(t))
            for k, t in tensors.items()}


def write_tensors(tmp: Path, tensors: dict, group=None) -> SummingWriter:
    """Every rank, a collective: DCP plans which rank writes each tensor (each Shards' chunk at
    its global offsets, a replicated one once), then each writes its files (fsynced, each item
    checksummed as written) and rank 0 the metadata. The writer: on rank 0, every checksum."""
    writer = SummingWriter(tmp)
    dcp.save(tensors, storage_writer=writer, planner=SavePlanner(), process_group=group,
             no_dist=not dist.is_initialized())
    return writer


def write_in_background(tmp: Path, staged: dict, timeout_s: float = 1800.0,
                        before=None) -> concurrent.futures.Future:
    """`write_tensors` of a staged copy on a thread of its own and a group of its own (on the
    training's group its collectives would interleave with the step's); a future of its end.
    torch's `dcp.async_save` does the same but stages inside the call, where one rank's
    failure would leave the others' writes waiting for it. `before()` runs first, on the thread
    (train.fault_sleep_in=checkpoint_write: a slow disk)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    group = _background_group(dist.group.WORLD, timeout_s)

    def write() -> None:
        try:
            if before is not None:
                before()
            done.set_result(write_tensors(tmp, staged, group))
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException: raised by result()
            done.set_exception(e)

    threading.Thread(target=write, name="minddp-checkpoint", daemon=True).start()
    return done


@functools.cache
def _background_group(world, timeout_s: float):
    """A gloo group for background writes, one per process group `world` (made at the first
    background write: a collective every rank reaches at the same step), timing out as the
    training's collectives do (train.timeout_s)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


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
    try:
        tmp.rename(final)
    except OSError:
        put_back(aside)  # a failed save never costs the checkpoint it was replacing
        raise
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def recover(tmp: Path) -> bool:
    """A temporary folder left by a crash: put in place if its save was whole (integrity.json
    written, only the rename missing) and nothing holds its name; True if it was."""
    return (tmp / INTEGRITY).is_file() and _renamed_back(tmp, ".tmp-")


def put_back(aside: Path) -> bool:
    """A folder `publish` set aside (`.ckpt_<step>.old-<id>`) back under its name, when nothing
    took that name; True if it was."""
    return aside.is_dir() and _renamed_back(aside, ".old-")


def _renamed_back(hidden: Path, marker: str) -> bool:
    """`.ckpt_<step><marker><id>` renamed to `ckpt_<step>`, unless that name is taken."""
    final = hidden.with_name(hidden.name.split(marker)[0].lstrip("."))
    if final.exists():
        return False
    hidden.rename(final)
    fsync_dir(final.parent)
    return True


# ----------------------------------------------------------------------------- reading
def load_folder(folder: Path, device) -> dict:
    """The whole state of a folder checkpoint, as a single-file checkpoint holds it.
    CorruptFolder for a damaged folder, UnsafeIndex for a `.metadata` that is not DCP's index
    (dcp_reader.py: read without running code); OSError (transient) for a failed read."""
    sums, small, stored = _opened(folder, device)
    targets, wholes = _targets(stored, small, device)
    _dcp_load(folder, sums, targets)
    return {k: (_join(v, wholes) if k in LARGE else v) for k, v in small.items()}


def open_folder(folder: Path, device) -> dict:
    """The state with a meta tensor (the stored shape and dtype) for each large one: nothing of
    them read; a folder of 0.6 (whole-file checksums only) is loaded whole."""
    sums, small, stored = _opened(folder, device)
    if _version(sums) < 2:
        return load_folder(folder, device)
    metas = {}
    for ref in (r for k in LARGE for r in _refs(small.get(k))):
        meta = _tensor_meta(stored, ref[REF])
        metas[ref[REF]] = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
    return {k: (_join(v, metas) if k in LARGE else v) for k, v in small.items()}


def load_into(folder: Path, targets: dict) -> int:
    """Every rank: DCP's distributed load of `targets` (this rank's own parts), each stored item
    read checked; the bytes this rank read."""
    sums = _integrity(folder)
    if _version(sums) < 2:
        raise CorruptFolder("a folder of minddp 0.6 is loaded whole, not in place")
    return _dcp_load(folder, sums, targets, distributed=dist.is_initialized())


def _dcp_load(folder: Path, sums: dict, targets: dict, distributed: bool = False) -> int:
    reader = CheckedReader(folder, sums["chunks"]) if _version(sums) >= 2 else SafeReader(folder)
    with warnings.catch_warnings():  # no_dist without a process group is what we mean
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(targets, storage_reader=reader, planner=LoadPlanner(), no_dist=not distributed)
    return getattr(reader, "bytes_read", 0)


def _opened(folder: Path, device) -> tuple[dict, dict, dict]:
    """(integrity.json, the small state, DCP's index of stored tensors): every file there and of
    its size; the small files' checksums (0.6's folders: every file's, all read)."""
    sums = _integrity(folder)
    if _version(sums) < 2:
        verify_files(folder, sums)
        small = torch.load(folder / STATE, map_location=device, weights_only=True)
        index = SafeReader(folder).read_metadata()
    else:
        _check_sizes(folder, sums["files"])
        small = torch.load(io.BytesIO(_checked_bytes(folder, STATE, sums["files"][STATE])),
                           map_location=device, weights_only=True)
        index = read_index(_checked_bytes(folder, ".metadata", sums["files"][".metadata"]))
    if not isinstance(small, dict):
        raise CorruptFolder(f"{STATE} holds a {type(small).__name__}, not a dict")
    return sums, small, index.state_dict_metadata


def _integrity(folder: Path) -> dict:
    try:
        sums = json.loads((folder / INTEGRITY).read_text())
    except FileNotFoundError:
        raise CorruptFolder(f"no {INTEGRITY}: an interrupted save, not a whole checkpoint") from None
    except ValueError as e:
        raise CorruptFolder(f"{INTEGRITY} does not parse: {e}") from None
    listed = sums.get("files", {}) if _version(sums) >= 2 else sums
    if not isinstance(listed, dict) or STATE not in listed or ".metadata" not in listed:
        raise CorruptFolder(f"{INTEGRITY} lists neither {STATE} nor DCP's .metadata")
    return sums


def _version(sums: dict) -> int:
    """integrity.json's layout: 2 (every stored item's CRC-32, minddp 0.7) or 1 (every file's)."""
    return 2 if isinstance(sums.get("version"), int) and sums["version"] >= 2 else 1


def _check_sizes(folder: Path, files: dict) -> None:
    for name, (size, _) in sorted(files.items()):
        try:
            got = (folder / name).stat().st_size
        except FileNotFoundError:
            raise CorruptFolder(f"{name} is missing") from None
        if got != size:
            raise CorruptFolder(f"{name} holds {got} bytes, {size} were written")


def _checked_bytes(folder: Path, name: str, size_crc) -> bytes:
    data = (folder / name).read_bytes()
    if len(data) != size_crc[0] or zlib.crc32(data) != size_crc[1]:
        raise CorruptFolder(f"checksum mismatch in {name} (a flipped bit or a damaged copy)")
    return data


def verify_files(folder: Path, sums: dict) -> None:
    """A folder of minddp 0.6: every file integrity.json lists, of its size and CRC-32 (all of it
    read); CorruptFolder if not."""
    _check_sizes(folder, sums)
    for name, (_, crc) in sorted(sums.items()):
        if _crc(folder / name) != crc:
            raise CorruptFolder(f"checksum mismatch in {name} (a flipped bit or a damaged copy)")


def _targets(stored, small: dict, device) -> tuple[dict, dict]:
    """DCP's load targets for every reference in `small`: a whole tensor per name, and a view
    into one per part of a joined tensor (0.6's ZeRO-1 parts, `<name>@<offset>`);
    ({DCP key: tensor}, {reference name: whole tensor})."""
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
