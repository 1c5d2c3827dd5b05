"""A fingerprint of the data files a run reads: resume refuses other bytes under the same
data.dir/data.path (resume/check.py), and the ranks must all read the same (sources.py).

The files' names and sizes plus a hash of their bytes: whole files up to 4 MiB, else the
first and last 64 KiB and 16 blocks of 4 KiB spread over the file (cheap on any size; an edit
of the same length between two samples of a big file goes unseen).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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
