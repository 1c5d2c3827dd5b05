"""Files the tests write and read: token files in nanoGPT's and llm.c's formats, a text corpus,
a pickle that runs code when loaded, a minimal checkpoint and ways to damage one, a small real
disk that fills up, and what the tools write (markdown tables, plot lines)."""

from __future__ import annotations

import contextlib
import pickle
import random
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minddp.train import checkpoint
from minddp.train.checkpoint import integrity
from minddp.train.data.tokens import LLMC_MAGIC


def write_llmc(path, ids, version=1, count=None, magic=LLMC_MAGIC):
    """An llm.c shard: a 256-int32 header (magic, version, token count), then the tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [magic, version, len(ids) if count is None else count]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(ids, dtype=np.uint16 if version == 1 else np.uint32).tobytes())


def llmc_folder(folder, version=1, n=300):
    """Two train shards and a val shard of n tokens each."""
    folder.mkdir(parents=True, exist_ok=True)
    write_llmc(folder / "fw_train_000001.bin", np.arange(n) % 97, version)
    write_llmc(folder / "fw_train_000002.bin", np.arange(n) % 89, version)
    write_llmc(folder / "fw_val_000000.bin", np.arange(n) % 83, version)
    return folder


def _nanogpt_files(folder, ids, n_train, vocab, meta):
    folder.mkdir(parents=True, exist_ok=True)
    ids[:n_train].astype(np.uint16).tofile(folder / "train.bin")
    ids[n_train:].astype(np.uint16).tofile(folder / "val.bin")
    if meta:
        with open(folder / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": vocab}, f)


def nanogpt(folder, n_train=400, n_val=100, vocab=50, meta=True):
    """nanoGPT's train.bin/val.bin (+ meta.pkl) holding 0, 1, ... mod vocab; returns the folder."""
    _nanogpt_files(folder, np.arange(n_train + n_val) % vocab, n_train, vocab, meta)
    return folder


def write_nanogpt(folder, vocab=50, n_train=20_000, n_val=4_000, meta=True, seed=0):
    """nanoGPT's files holding a learnable stream (runs of an arithmetic progression mod vocab);
    returns the stream."""
    g = np.random.default_rng(seed)
    stream = np.cumsum(g.integers(1, 4, size=n_train + n_val)) % vocab
    _nanogpt_files(folder, stream, n_train, vocab, meta)
    return stream


def tokens_config(folder, dtype="auto"):
    """The data=tokens config node, as data.load_tokens reads it."""
    return SimpleNamespace(name="tokens", dir=str(folder), dtype=dtype)


def corpus(path, text="the quick brown fox jumps over the lazy dog. ", repeat=400):
    path.write_text(text * repeat)
    return path


def hidden_leftovers(folder) -> list[str]:
    """Names starting with a dot: temporaries a writer left behind."""
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


class RunsCode:
    """Unpickled, it would create `RunsCode.marker`: a safe loader must refuse it."""

    marker = None

    def __reduce__(self):
        import os

        return (os.system, (f"touch {RunsCode.marker}",))


# a checkpoint's contents at their smallest: what save_file/checkpoint.load need, nothing trained
TINY_STATE = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {}, "param_groups": [{"params": [0]}]},
              "scheduler": {"last_epoch": 0}, "rng": [{"cpu": torch.get_rng_state()}]}


def save_file(run_dir, step, state):
    """One process writes `state` as the checkpoint file of `step` (no collective)."""
    return checkpoint.FILE.write(checkpoint.FILE.path(run_dir, step), state)


def write_folder(final, state):
    """A folder checkpoint written by one process, as FOLDER.save does it on every rank."""
    from minddp.train.checkpoint import folders

    small, tensors = folders.split(state)
    tmp, small_sum = folders.begin_with(final, small)
    saving = folders.BackgroundSave(0, final, tmp, "write", None, small_sum)
    saving.writer = folders.write_tensors(tmp, tensors)
    folders.publish(tmp, final, saving.integrity())
    return final


def snapshot(paths) -> dict:
    """Each file's bytes and modification time: to show a failed operation left them alone."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}


def corrupt(path, kind):
    """Damage checkpoint `path` one way (tests/unit/test_resume_edges.py's KINDS; also make
    soak-faults' corrupt phase)."""
    data = path.read_bytes()
    if kind.startswith("truncated"):
        path.write_bytes(data[: int(kind.split(":")[1])])
    elif kind.startswith("random"):
        path.write_bytes(random.Random(int(kind.split(":")[1])).randbytes(20_000))
    elif kind == "dangling symlink":
        path.unlink()
        path.symlink_to(path.parent / "gone.pt")
    elif kind == "folder":
        path.unlink()
        path.mkdir()
    elif kind == "flipped bit":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(flipped))
    else:  # a nested key missing, or a tensor of another shape: saved with valid checksums
        state = torch.load(path, weights_only=True)
        state.pop(integrity.KEY)
        if kind == "wrong shape":
            state["model"][next(iter(state["model"]))] = torch.zeros(3, 3)
        elif kind == "wrong optimizer shape":
            state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(2)
        else:
            outer, _, inner = kind.partition(".")
            (state[outer] if inner else state).pop(inner or outer)
        save_file(path.parent.parent, state["step"], state)


def md_rows(text: str) -> list[dict]:
    """A markdown table's rows as {header: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    return [dict(zip(cells(lines[0]), cells(line))) for line in lines[2:]]


def line_data(ax):
    """A matplotlib axis's lines as (xs, ys)."""
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]


@contextlib.contextmanager
def small_disk(where, size_mb: int):
    """A tmpfs of `size_mb` mounted at `where` (root), unmounted after; the test is skipped
    where mount is not permitted."""
    where.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
                       capture_output=True)
    if p.returncode:
        pytest.skip(f"mount -t tmpfs not permitted: {p.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
