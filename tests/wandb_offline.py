"""W&B's offline files read back, for the tests (no server here). wandb 0.31 writes a run as
`<dir>/wandb/offline-run-*/run-<id>.wandb`: its own protobuf records (wandb.proto) in a
LevelDB-style log (32 KiB blocks, 7-byte headers; a record may span blocks). wandb no longer
ships a Python reader, so this is the format's reader, parsed with wandb's own protobuf classes."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK, HEADER = 32768, 7


def records(path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, path
    pos, buf = 7, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and n == 0:
            pos += left
            continue
        buf += data[pos + HEADER:pos + HEADER + n]
        pos += HEADER + n
        if kind in (1, 4):  # FULL or LAST (FIRST and MIDDLE accumulate)
            r = pb.Record()
            r.ParseFromString(buf)
            buf = b""
            yield r


def _items(items) -> dict:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def read_run(run_file) -> dict:
    """One offline run: its name, group, job type, tags, config, summary (as W&B keeps it:
    the last update of each key), history rows, the chart specs and where it branched from."""
    out = {"file": Path(run_file), "history": [], "summary": {}, "config": {}, "charts": {}}
    for r in records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, name=r.run.display_name, group=r.run.run_group,
                       job_type=r.run.job_type, tags=list(r.run.tags), project=r.run.project,
                       branch=(r.run.branch_point.run, r.run.branch_point.value)
                       if r.run.HasField("branch_point") else None)
            out["config"].update(_items(r.run.config.update))
        elif kind == "config":
            for key, value in _items(r.config.update).items():
                if key.startswith("_wandb/visualize/"):
                    out["charts"][key.removeprefix("_wandb/visualize/")] = value
                else:
                    out["config"][key] = value
        elif kind == "history":
            out["history"].append(_items(r.history.item))
        elif kind == "summary":
            out["summary"].update(_items(r.summary.update))
    return out


def finished(run_file, timeout: float = 20.0) -> Path:
    """run_file once W&B's service has written its exit record: `run.finish()` returns before the
    service (a process of its own) has flushed the file, which on a loaded machine can take
    seconds. After `timeout` the file as it is (a run that never finished)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(r.WhichOneof("record_type") == "exit" for r in records(run_file)):
                break
        except Exception:  # noqa: BLE001 - a file still being written (a header or record cut short)
            pass
        time.sleep(0.1)
    return Path(run_file)


def runs_under(folder) -> list[dict]:
    """Every offline run under a folder, in the order they started, each once it is written."""
    return [read_run(finished(f)) for f in sorted(Path(folder).rglob("offline-run-*/run-*.wandb"),
                                                  key=lambda f: f.parent.name)]


def table(run: dict, key: str) -> dict:
    """A logged wandb.Table (or a chart's table) as {"columns": [...], "data": [[...], ...]}."""
    path = run["file"].parent / "files" / run["summary"][f"{key}/path"]
    return json.loads(path.read_text())
