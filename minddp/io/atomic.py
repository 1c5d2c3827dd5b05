"""Atomic file writes: a temporary file beside the target, fsync, then a rename.

A crash leaves the old file or the new one, never half of one. The temporary file is
`.<name>.<random>.tmp` in the same folder (a rename is only atomic within a file system);
whatever a crash leaves of it is removed on the error path, or by `remove_orphans`. The file
gets the mode an `open()` would give it (0o666 less the umask; an existing target keeps its
own), not mkstemp's 0600.
"""

from __future__ import annotations

import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("minddp")


@contextmanager
def atomic_open(path, mode: str = "wb"):
    """Open a temporary file for writing; on a clean exit it replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _mode_of(path))
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself reaches the disk
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        old = os.umask(0o022)
        os.umask(old)
        return old


def _mode_of(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~umask()


def atomic_write(path, data: bytes | str) -> Path:
    """Write `data` (bytes, or text as UTF-8) to `path` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


def remove_orphans(folder, name_glob: str = "*") -> list[Path]:
    """Delete the temporary files an earlier crash left for targets matching `name_glob`."""
    folder = Path(folder)
    return remove_files(folder.glob(f".{name_glob}.*.tmp")) if folder.is_dir() else []


def remove_files(paths) -> list[Path]:
    """Unlink each of `paths` (files left by interrupted writes); those removed. A folder of such
    a name is no file of ours and is left alone, and a removal that fails is kept: a warning each,
    never an error (start-up clean-up must not stop a run)."""
    removed = []
    for p in paths:
        try:
            if p.is_dir() and not p.is_symlink():
                log.warning(f"{p} is a folder named like the temporary file of an interrupted write; "
                            "minddp writes no such folder: left as it is")
                continue
            p.unlink(missing_ok=True)
        except OSError as e:
            log.warning(f"could not remove {p}, left by an interrupted write ({e.strerror or e}): "
                        "remove it by hand")
            continue
        removed.append(p)
    return removed


def fsync_dir(d) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
