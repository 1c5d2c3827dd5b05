"""DCP's `.metadata` read without running code: the one reader of every path that opens a folder
checkpoint (resume, `minddp export`/`sample`/`debug`/`report`, `model.init_from` of a checkpoint).

torch's `FileSystemReader.read_metadata` opens `.metadata` with a plain `pickle.load`, and a
folder's integrity.json is a CRC list anyone can recompute: a planted `ckpt_<step>/` would run
its payload on load. torch's `weights_only` unpickler cannot read the file either (DCP pickles
with protocol 4: FRAME, STACK_GLOBAL, MEMOIZE, which it does not implement), so `SafeReader`
reads it with minddp/io/safe_pickle's restricted unpickler, admitting exactly the classes DCP's
index is made of, then checks the index holds what minddp writes: tensors only (DCP would load
any other entry with `torch.load(weights_only=False)`), each in a file directly in the folder.
"""

from __future__ import annotations

import functools
import pathlib
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_meta

from ...io import safe_pickle


class UnsafeIndex(ValueError):
    """A `.metadata` that names anything DCP's index is not made of, or is not DCP's index."""


# what DCP's pickle.dump names, by name as the file does (a torch that renamed one would write,
# and need, the new name); pathlib's as Python 3.11-3.12 and 3.13+ pickle them
_META = ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
         "MetadataIndex", "_MEM_FORMAT_ENCODING")
_NAMES = {("torch.distributed.checkpoint.metadata", n) for n in _META} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout")} | {
    (m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "PurePosixPath")}


@functools.cache
def allowed() -> frozenset:
    """{(module, name)} of everything a `.metadata` DCP writes may name: its classes, torch's dtypes."""
    dtypes = {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    return frozenset(_NAMES | dtypes)


def read_index(data: bytes) -> dcp_meta.Metadata:
    """DCP's index from the bytes of a `.metadata`; UnsafeIndex if it is anything else."""
    try:
        index = safe_pickle.loads(data, allowed())
    except safe_pickle.UnsafePickleError as e:
        raise UnsafeIndex(f"DCP's .metadata was refused: {e}") from None
    except Exception as e:  # noqa: BLE001 - truncated, or not a pickle: damaged either way
        raise UnsafeIndex(f"DCP's .metadata does not parse: {type(e).__name__}: {str(e)[:160]}") from None
    if problem := _problem(index):
        raise UnsafeIndex(f"DCP's .metadata {problem}")
    return index


def _problem(index) -> str | None:
    if not isinstance(index, dcp_meta.Metadata):
        return f"holds a {type(index).__name__}, not DCP's Metadata"
    entries, files = index.state_dict_metadata, index.storage_data
    if not isinstance(entries, dict) or not isinstance(files, dict):
        return "is not DCP's index (no entries or storage table)"
    for name, entry in entries.items():
        if not isinstance(entry, dcp_meta.TensorStorageMetadata):
            return f"entry {name!r} is a {type(entry).__name__}: minddp's folders hold tensors only"
    for info in files.values():  # _StorageInfo: the unpickler admitted no other class with this field
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or path in ("", ".", "..") or pathlib.PurePath(path).name != path:
            return f"names a data file outside its folder: {path!r}"
    return None


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, its `.metadata` read by `read_index`."""

    def read_metadata(self, *args, **kwargs) -> dcp_meta.Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            index = read_index(f.read())
        if getattr(index, "storage_meta", None) is None:  # as torch's read_metadata
            index.storage_meta = dcp_meta.StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


def to_torch_save(folder, out) -> None:
    """One torch.save file of every tensor in a folder, keyed as DCP stores them (what torch's
    `dcp_to_torch_save` gives for minddp's folders, whose index holds tensors only), read
    through a SafeReader: DCP's public load into tensors of the index's shapes."""
    reader = SafeReader(folder)
    index = reader.read_metadata()  # UnsafeIndex here, in one line
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in index.state_dict_metadata.items()}
    with warnings.catch_warnings():  # no_dist without a process group is what we mean
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    torch.save(state, out)
