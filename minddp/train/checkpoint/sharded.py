"""Each rank's own part of a tensor, in the tensor's global coordinates, for DCP: what a folder
checkpoint writes and what a resume reads back in place, so a rank reads only what it holds.

    Shards.of_param(local, spec, tp_size, tp_rank)        a parameter's tp slice (or all of it)
    Shards.of_flat_range(shape, lo, flat, spec, tp, r)    ZeRO-1's [lo, lo + n) of a flattened slice
    SavePlanner / LoadPlanner                             DCP's default planners, taking Shards
    SummingWriter                                         DCP's writer; CRC-32 of each item as written
    CheckedReader                                         DCP's reader; each item's CRC-32 checked as read

Every tensor keeps its global shape on disk (a parameter's, for its optimizer states too, sharded
or not): DCP's planner matches what a rank holds against the chunks stored, so any dp, tp and
ZeRO-1 layout reads any other. A chunk is a rectangle of the global tensor: a tp slice of a fused
parameter (qkv) is one per part, a flat ZeRO-1 range of a 2-D slice up to three rows-blocks.
"""

from __future__ import annotations

import dataclasses
import io
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from ... import _compat
from .dcp_reader import SafeReader


class ModelMismatch(Exception):
    """The stored tensors are not this run's model's (another shape, a name it does not hold): a
    different model, not damage; no older checkpoint of the run would do either."""


class CorruptChunk(Exception):
    """Bytes read that are not the bytes written (a checksum, a length), or a chunk that does
    not fit the checkpoint's index."""


# ----------------------------------------------------------------------------- what a rank holds
@dataclasses.dataclass
class Shards:
    """A tensor of global `size`, of which this rank holds `chunks`: (global offsets, a view)."""

    size: torch.Size
    chunks: list[tuple[tuple[int, ...], torch.Tensor]]

    @classmethod
    def of_param(cls, local: torch.Tensor, spec=None, tp_size: int = 1, tp_rank: int = 0) -> Shards:
        """`local`, a parameter's tensor (or one shaped as it) as tensor parallelism cut it:
        `spec` = (dim, parts) as `tp_shard`; None or tp 1: the whole tensor."""
        layout = _tp_layout(local.shape, spec, tp_size, tp_rank)
        size = _global_size(local.shape, layout)
        return cls(size, list(_to_global((0,) * local.dim(), local, layout)))

    @classmethod
    def of_flat_range(cls, shape, lo: int, flat: torch.Tensor, spec=None, tp_size: int = 1,
                      tp_rank: int = 0) -> Shards:
        """ZeRO-1's part `flat` = elements [lo, lo + n) of a flattened tp slice of `shape`."""
        shape = torch.Size(shape)
        layout = _tp_layout(shape, spec, tp_size, tp_rank)
        chunks = []
        for offsets, sizes, start in _rectangles(shape, lo, flat.numel()):
            view = flat[start:start + sizes.numel()].view(sizes)
            chunks.extend(_to_global(offsets, view, layout))
        return cls(_global_size(shape, layout), chunks)

    def at(self, offsets) -> torch.Tensor:
        for o, t in self.chunks:
            if tuple(o) == tuple(offsets):
                return t
        raise KeyError(f"no chunk at {tuple(offsets)}")

    def write_items(self, fqn: str) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t), size=self.size))
                for o, t in self.chunks]

    def chunk_list(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in self.chunks]


def _tp_layout(local_shape, spec, tp_size: int, tp_rank: int):
    """(dim, local length per part, global start of each part's slice, global length) or None
    (not split)."""
    if not spec or tp_size == 1 or len(local_shape) == 0:
        return None
    dim, parts = spec
    whole = local_shape[dim] * tp_size
    mine = [p.chunk(tp_size)[tp_rank] for p in torch.arange(whole).chunk(parts)]
    if any(m.numel() * parts != local_shape[dim] for m in mine):
        raise ValueError(f"a tensor of {whole} along dim {dim} does not split evenly into "
                         f"{parts} part(s) x tp {tp_size}")
    return dim, mine[0].numel(), [int(m[0]) for m in mine], whole


def _global_size(local_shape, layout) -> torch.Size:
    size = list(local_shape)
    if layout is not None:
        size[layout[0]] = layout[3]
    return torch.Size(size)


def _to_global(offsets, view: torch.Tensor, layout):
    """(global offsets, view) for a local rectangle at `offsets`, split at the tp parts."""
    if layout is None:
        yield tuple(offsets), view
        return
    dim, per_part, starts, _ = layout
    x0 = offsets[dim]
    x, x1 = x0, x0 + view.shape[dim]
    while x < x1:
        p, off = divmod(x, per_part)
        end = min(x1, (p + 1) * per_part)
        o = list(offsets)
        o[dim] = starts[p] + off
        yield tuple(o), view.narrow(dim, x - x0, end - x)
        x = end


def _rectangles(shape: torch.Size, lo: int, n: int):
    """The flat range [lo, lo + n) of a tensor of `shape` (at most 2-D) as row-major rectangles:
    (offsets, sizes, start in the range)."""
    if len(shape) == 0:
        yield (), torch.Size([]), 0
        return
    if len(shape) == 1:
        yield (lo,), torch.Size([n]), 0
        return
    if len(shape) > 2:
        raise ValueError(f"a ZeRO-1 state of a {len(shape)}-D parameter {tuple(shape)}: folder "
                         "checkpoints place at most 2-D ones (use train.ckpt_format=file)")
    cols, hi = shape[1], lo + n
    r0, c0 = divmod(lo, cols)
    r1, c1 = divmod(hi, cols)
    if r0 == r1:
        if n:
            yield (r0, c0), torch.Size([1, c1 - c0]), 0
        return
    start = 0
    if c0:
        yield (r0, c0), torch.Size([1, cols - c0]), 0
        r0, start = r0 + 1, cols - c0
    if r1 > r0:
        yield (r0, 0), torch.Size([r1 - r0, cols]), start
        start += (r1 - r0) * cols
    if c1:
        yield (r1, 0), torch.Size([1, c1]), start


def _tensor_record(stream, offset: int, length: int):
    """Where torch.save's zip at [offset, offset + length) keeps the tensor's bytes (the one
    `.../data/0` record, stored): (start, size within the item, bytes read to find it), or None.
    torch writes sizes after the data (descriptors): they are read from the central directory."""
    if length < 22:
        return None
    stream.seek(offset + length - 22)
    end = stream.read(22)
    if len(end) != 22 or end[:4] != b"PK\x05\x06":
        return None
    size, at = int.from_bytes(end[12:16], "little"), int.from_bytes(end[16:20], "little")
    if at + size > length - 22 or size > (1 << 20):  # (zip64: 0xFFFFFFFF, read the other way)
        return None
    stream.seek(offset + at)
    directory = stream.read(size)
    record, i = None, 0
    while i + 46 <= len(directory) and directory[i:i + 4] == b"PK\x01\x02":
        n, extra, note = (int.from_bytes(directory[i + k:i + k + 2], "little") for k in (28, 30, 32))
        if directory[i + 46:i + 46 + n].endswith(b"/data/0"):
            if record is not None or int.from_bytes(directory[i + 10:i + 12], "little") != 0:
                return None
            record = (int.from_bytes(directory[i + 20:i + 24], "little"),
                      int.from_bytes(directory[i + 42:i + 46], "little"))
        i += 46 + n + extra + note
    if record is None or record[1] + 30 > length:
        return None
    stream.seek(offset + record[1])
    local = stream.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        return None
    start = record[1] + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    if start + record[0] > length:
        return None
    return start, record[0], 22 + len(directory) + 30


# ----------------------------------------------------------------------------- DCP's planners
class SavePlanner(DefaultSavePlanner):
    """DCP's default, with Shards written chunk by chunk at their global offsets."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            items += obj.write_items(fqn) if isinstance(obj, Shards) else _compat.create_write_items(fqn, obj)
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.at(index.offset) if isinstance(obj, Shards) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default, reading into Shards (only the stored chunks they overlap) and tensors
    (whole); a target of another size than stored is a ModelMismatch."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default's first pass (meta tensors made real) would replace a Shards by None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        stored = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            md = stored.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise ModelMismatch(f"it holds no tensor {fqn}")
            size = obj.size if isinstance(obj, Shards) else obj.size()
            if torch.Size(md.size) != torch.Size(size):
                raise ModelMismatch(f"{fqn} is stored as {tuple(md.size)}, this run holds {tuple(size)}")
            if problem := _tiling_problem(md):
                raise CorruptChunk(f"the stored parts of {fqn} {problem}")
            chunks = obj.chunk_list() if isinstance(obj, Shards) else [_compat.create_chunk_from_tensor(obj)]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.at(index.offset) if isinstance(obj, Shards) else obj


def _tiling_problem(md: TensorStorageMetadata) -> str | None:
    """Stored chunks that leave a hole in the tensor or overlap (a save that was not whole)."""
    size, seen = torch.Size(md.size), 0
    boxes = []
    for c in md.chunks:
        inside = all(0 <= o and o + n <= s for o, n, s in zip(c.offsets, c.sizes, size))
        if len(c.offsets) != len(size) or not inside:
            return f"reach outside its shape {tuple(size)}"
        seen += torch.Size(c.sizes).numel()
        boxes.append((tuple(c.offsets), tuple(c.sizes)))
    if seen != size.numel():
        return f"hold {seen} of its {size.numel()} elements"
    if len(boxes) <= 64:  # pairwise: a save's few chunks per tensor
        for i, (a, m) in enumerate(boxes):
            for b, n in boxes[i + 1:]:
                if all(x < y + k and y < x + j for x, j, y, k in zip(a, m, b, n)) and m and n:
                    return "overlap"
    return None


# ----------------------------------------------------------------------------- checksums in passing
class _Crc:
    """A write-only stream that keeps the CRC-32 and count of what goes through it."""

    def __init__(self, inner):
        self.inner, self.crc, self.size = inner, 0, 0

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)
        self.size += memoryview(b).nbytes
        return self.inner.write(b)

    def __getattr__(self, name):  # tell, fileno, flush, close: the file's own
        return getattr(self.inner, name)


class _Summing(_compat.StorageWriterTransforms):
    """Each write item's bytes summed as DCP writes them: {MetadataIndex: crc}."""

    def __init__(self):
        super().__init__(())
        self.crcs: dict = {}

    def transform_save_stream(self, write_item, raw_stream):
        stream, descriptors = super().transform_save_stream(write_item, raw_stream)
        return _ItemStream(stream, self.crcs, write_item.index), descriptors


class _ItemStream(io.RawIOBase):
    """One item's stream: summed as written, its CRC-32 recorded when DCP closes it."""

    def __init__(self, inner, crcs: dict, index):
        super().__init__()
        self.inner, self.crcs, self.index, self.crc = inner, crcs, index, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)
        return self.inner.write(b)

    def close(self) -> None:
        if not self.closed:
            self.crcs[self.index] = self.crc
            self.inner.close()
        super().close()


class _SummingFS(FileSystem):
    """DCP's file system, keeping (size, CRC-32) of the .metadata it writes."""

    def __init__(self):
        super().__init__()
        self.written: dict[str, tuple[int, int]] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if mode != "wb" or not Path(path).name.endswith(".metadata.tmp"):
                yield stream
                return
            summed = _Crc(stream)
            yield summed
            self.written[".metadata"] = (summed.size, summed.crc)


class SummingWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter (fsynced files), summing every item as it is written. After the
    save, on the coordinator (rank 0): `chunks` [[file, offset, length, crc], ...] of every
    rank's items, and `metadata_sum` (size, crc) of .metadata; nothing is read back."""

    def __init__(self, path):
        super().__init__(path)
        self.transforms = _Summing()
        self.fs = _SummingFS()
        self.chunks: list | None = None
        self.metadata_sum: tuple[int, int] | None = None

    def write_data(self, plan, planner) -> Future:
        results = super().write_data(plan, planner).wait()
        crcs = self.transforms.crcs
        done: Future = Future()
        done.set_result([dataclasses.replace(r, storage_data=(r.storage_data, crcs[r.index]))
                         for r in results])
        return done

    def finish(self, metadata, results) -> None:
        chunks, plain = [], []
        for per_rank in results:
            plain.append([dataclasses.replace(r, storage_data=r.storage_data[0]) for r in per_rank])
            for r in per_rank:
                info, crc = r.storage_data
                chunks.append([info.relative_path, info.offset, info.length, crc])
        super().finish(metadata, plain)
        self.chunks, self.metadata_sum = sorted(chunks), self.fs.written[".metadata"]


DIRECT_BYTES = 1 << 17  # glibc's initial mmap threshold: smaller buffers come and go on the heap


class CheckedReader(SafeReader):
    """DCP's FileSystemReader (its .metadata read without running code: dcp_reader.py), reading
    each stored item whole (as DCP does) and checking its length and CRC-32 against `chunks`.
    An item of DIRECT_BYTES or more that is exactly its target (a resume at the layout that saved
    it) is read straight into the target's memory, summed on the way: no buffer, no second
    tensor (their frees before the first step raised glibc's mmap threshold: +10% peak RSS).
    Any other is checked before torch sees a byte, then loaded and narrowed as DCP does; an item
    read for several targets in a row is read once. `bytes_read` counts what was read."""

    def __init__(self, path, chunks: list):
        super().__init__(path)
        self.expected = {(f, o): (n, crc) for f, o, n, crc in chunks}
        self.bytes_read = 0
        self._last: tuple = (None, b"")

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for req in reqs:
                    sinfo = self.storage_data[req.storage_index]
                    if req.type == LoadItemType.BYTE_IO or sinfo.transform_descriptors:
                        raise CorruptChunk(f"{relative_path}: an item that is no plain tensor")
                    target = planner.resolve_tensor(req).detach()
                    if not self._read_into(stream, sinfo, req, target):
                        tensor = torch.load(self._slice_file(stream, sinfo), map_location="cpu",
                                            weights_only=True)
                        tensor = _compat.narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                        if target.size() != tensor.size():
                            raise CorruptChunk(f"{relative_path}: a stored item of {tuple(tensor.size())}, "
                                               f"its target {tuple(target.size())}")
                        target.copy_(tensor)
                    planner.commit_tensor(req, target)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_into(self, stream, sinfo, req, target: torch.Tensor) -> bool:
        """The item's tensor bytes read into `target` itself when the item is exactly it (one
        record, stored, of the target's size; the target contiguous on the CPU); the item's other
        bytes around them, all summed in order. False where the item is not so."""
        if target.device.type != "cpu" or not target.is_contiguous() or any(req.storage_offsets) or \
                sinfo.length < DIRECT_BYTES:
            return False
        want = self.expected.get((sinfo.relative_path, sinfo.offset))
        if want is None or want[0] != sinfo.length:
            return False  # the checked path says what is wrong
        found = _tensor_record(stream, sinfo.offset, sinfo.length)
        if found is None or found[1] != target.numel() * target.element_size():
            return False
        start, size, overhead = found
        end = start + size
        stream.seek(sinfo.offset)
        head = stream.read(start)
        self.bytes_read += overhead
        if len(head) != start:
            return False
        into = memoryview(target.view(torch.uint8).reshape(-1).numpy()) if target.numel() else memoryview(b"")
        got = stream.readinto(into) if target.numel() else 0
        tail = stream.read(sinfo.length - end)
        self.bytes_read += len(head) + got + len(tail)
        if got != size or len(tail) != sinfo.length - end:
            raise CorruptChunk(f"{sinfo.relative_path} ends before byte {sinfo.offset + sinfo.length}")
        if zlib.crc32(tail, zlib.crc32(into, zlib.crc32(head))) != want[1]:
            raise CorruptChunk(f"checksum mismatch in {sinfo.relative_path} "
                               "(a flipped bit or a damaged copy)")
        return True

    def _slice_file(self, file, sinfo):
        where = (sinfo.relative_path, sinfo.offset)
        if self._last[0] == where:
            return io.BytesIO(self._last[1])
        want = self.expected.get(where)
        if want is None or want[0] != sinfo.length:
            raise CorruptChunk(f"{sinfo.relative_path}: the bytes at {sinfo.offset} are not the ones "
                               "integrity.json lists")
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        self.bytes_read += len(data)
        if len(data) != sinfo.length:
            raise CorruptChunk(f"{sinfo.relative_path} ends before byte {sinfo.offset + sinfo.length}")
        if zlib.crc32(data) != want[1]:
            raise CorruptChunk(f"checksum mismatch in {sinfo.relative_path} "
                               "(a flipped bit or a damaged copy)")
        self._last = (where, data)
        return io.BytesIO(data)
