"""Where a run's checkpoints live and how they are named, for both formats: `<run dir>/checkpoints/`
holds `ckpt_<step>.pt` files (files.py) and `ckpt_<step>/` folders (folders.py). Listing is by
name only (newest first; at one step a folder before a file): what is in an entry is its format's
to verify. A name starting with a dot is never a checkpoint: temporaries of writes in progress
(`.ckpt_<step>.pt.<random>.tmp`, `.ckpt_<step>.tmp-<id>/`) and checkpoints on their way out
(`.ckpt_<step>[.pt].trash-<id>`, see `discard`), which start-up removes.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from ...io.atomic import fsync_dir

NAME = re.compile(r"ckpt_(\d+)(\.pt)?$")
TRASH = ".ckpt_*.trash-*"
log = logging.getLogger("minddp")


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def name_for(step: int, suffix: str = "") -> str:
    return f"ckpt_{step:08d}{suffix}"


def step_of(path) -> int | None:
    """The step a checkpoint's name says, None for any other name."""
    m = NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def listed(folder) -> list[Path]:
    """The checkpoints (files and folders) directly in `folder`, newest first."""
    d = Path(folder)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), not m.group(2), p) for p in d.iterdir() if (m := NAME.match(p.name))]
    return [p for *_, p in sorted(found, reverse=True)]


def all_checkpoints(run_dir) -> list[Path]:
    """Newest first (at one step, a folder before a file)."""
    return listed(checkpoint_dir(run_dir))


def latest(run_dir) -> Path | None:
    found = all_checkpoints(run_dir)
    return found[0] if found else None


def is_checkpoint_folder(path) -> bool:
    """A `ckpt_<step>/` folder (train.ckpt_format=dcp): a checkpoint, not a run directory."""
    p = Path(path)
    return p.is_dir() and (m := NAME.match(p.name)) is not None and not m.group(2)


def write_problem(run_dir) -> str | None:
    """Why this process cannot create files in the run's checkpoints folder (or, before the
    first save made it, in the run dir), None if it can: a file is created there and gone at
    once (O_TMPFILE where the filesystem has it: nothing is left even by a kill)."""
    d = checkpoint_dir(run_dir)
    where = d if d.exists() else Path(run_dir)
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        return (f"cannot write checkpoints in {where} ({e.strerror or e}): make it writable (chmod u+w "
                f"{where}, or remount it read-write), or give the run another directory (MINDDP_RUN_DIR "
                "or hydra.run.dir); nothing was changed")
    return None


def discard(path: Path, pause=None) -> None:
    """Remove a checkpoint so that no kill leaves half of one where a resume would look: renamed
    to `.<name>.trash-<id>` first (one atomic rename; listing skips it, start-up removes it), the
    rename made durable, then removed. `pause()` runs between the two (fault injection).
    OSError if the rename fails (the checkpoint is then untouched); a removal that fails leaves
    the renamed one for the next start, with a warning."""
    trash = path.with_name(f".{path.name}.trash-{uuid.uuid4().hex[:8]}")
    path.rename(trash)
    fsync_dir(path.parent)
    if pause is not None:
        pause()
    try:
        remove(trash)
    except OSError as e:
        log.warning(f"could not remove {trash} ({e.strerror or e}): no longer a checkpoint; the next start "
                    "removes it")


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def trash_left(run_dir) -> list[Path]:
    """Checkpoints a kill caught between `discard`'s rename and its removal."""
    d = checkpoint_dir(run_dir)
    return sorted(d.glob(TRASH)) if d.is_dir() else []


def disk_bytes(run_dir) -> int:
    """What the run's checkpoints folder takes on disk (allocated blocks; sizes where the
    filesystem does not say)."""
    total = 0
    for root, _, names in os.walk(checkpoint_dir(run_dir)):
        for n in names:
            try:
                st = os.lstat(os.path.join(root, n))
            except OSError:  # removed meanwhile
                continue
            total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total
