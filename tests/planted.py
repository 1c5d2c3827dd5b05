"""A planted folder checkpoint (issue 56.1): its `.metadata` a pickle whose payload creates a
marker file when unpickled, its integrity.json recomputed (a CRC list anyone can write)."""

import json
import zlib

from minddp.train.checkpoint import folders


class Payload:
    """What an adversary's `.metadata` holds: unpickling it creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def replant(folder, metadata: bytes) -> None:
    """`folder`'s .metadata replaced, its integrity.json recomputed: whole by every checksum."""
    (folder / ".metadata").write_bytes(metadata)
    names = [p.name for p in folder.iterdir() if p.name != folders.INTEGRITY]
    sums = {n: [(folder / n).stat().st_size, zlib.crc32((folder / n).read_bytes())] for n in names}
    (folder / folders.INTEGRITY).write_text(json.dumps(sums))
