"""Resume checks the configuration: the saved one (in every checkpoint) against the new one.

Keys that decide which samples each step sees and what the model is (so that a resumed run
equals an uninterrupted one) must not change: REFUSED, unless train.resume_force=true; nor
may the global batch itself (weak scaling: it grows with the world size).
Everything else (max_steps, logging, evaluation, the lr schedule and optimizer settings,
micro-batch size, layout, engine settings) may change: it is applied and listed.
"""

from __future__ import annotations

import os

from ...errors import ConfigError

# seed: weights, dropout and the sampler's order; model.*: the network (block_size: the
# windows); the global batch: samples per step; data.*: the samples themselves
REFUSED = ("seed", "model.", "train.global_batch_size", "data.")
ALLOWED = ("data.cache_dir",  # where the tokenised text is cached, not what it is
           "model.init_from")  # where a fresh run's weights came from: a resume reads its checkpoint
NOT_LISTED = ("train.resume", "train.resume_force", "train.stop_at_step", "train.fault_")
PATHS = ("data.path", "data.dir")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(key: str, a, b) -> bool:
    if key in PATHS and isinstance(a, str) and isinstance(b, str):
        return a == b or os.path.realpath(a) == os.path.realpath(b)
    return a == b


def _matches(key: str, prefixes) -> bool:
    return any(key == p or (p[-1] in "._" and key.startswith(p)) for p in prefixes)


def changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(refused, applied): one `key: old -> new` line per changed key. A key only one side has
    (another minddp version's schema) is applied, never refused."""
    old, new = flatten(saved), flatten(current)
    refused, applied = [], []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if _same(key, a, b) or _matches(key, NOT_LISTED):
            continue
        line = f"{key}: {a!r} -> {b!r}"
        both = key in old and key in new
        (refused if both and _matches(key, REFUSED) and not _matches(key, ALLOWED) else applied).append(line)
    return refused, applied


def check(saved: dict | None, current: dict, force: bool, path) -> list[str]:
    """Raise ConfigError naming every refused change (unless force); return the lines to report."""
    if saved is None:
        return [f"{path} holds no saved configuration (older minddp): settings not compared"]
    refused, applied = changes(saved, current)
    if refused and not force:
        raise ConfigError(
            f"resuming from {path} with settings that change the run (a resumed run must equal an "
            "uninterrupted one):\n  " + "\n  ".join(refused) + "\nUse the saved values, start a new run "
            "directory, or set train.resume_force=true to resume anyway")
    return ([f"changed on resume (train.resume_force=true): {line}" for line in refused]
            + [f"changed on resume, applied: {line}" for line in applied])


def check_data(saved: dict | None, current: dict, force: bool, path) -> list[str]:
    """The data's fingerprint (integrity.fingerprint) against the checkpoint's: other bytes
    under the same data.dir/data.path are refused unless force; returns the lines to report."""
    old = (saved or {}).get("fingerprint") if isinstance(saved, dict) else None
    new = current.get("fingerprint")
    if old is None or new is None or old == new:
        return []
    line = f"data fingerprint {old} -> {new} (files of {current.get('dir') or 'the data'})"
    if not force:
        raise ConfigError(f"resuming from {path} on other data than it was trained on: {line}. The files "
                          "changed since the checkpoint: restore them, start a new run directory, or set "
                          "train.resume_force=true to resume anyway")
    return [f"changed on resume (train.resume_force=true): {line}"]


def check_global_batch(saved: dict, config: dict, global_batch: int | None, force: bool, path) -> list[str]:
    """Samples per step, the checkpoint's (samples_seen / step: 0.4's checkpoints have both)
    against this run's. Under train.scaling=weak it is train.global_batch_size x dp: the same
    keys on another world size change which samples each step sees, which `check` cannot see.
    A changed train.global_batch_size is `check`'s to refuse (one line, not two)."""
    step, seen = saved.get("step"), saved.get("samples_seen")
    if global_batch is None or not isinstance(step, int) or step < 1 or not isinstance(seen, int):
        return []
    old = seen // step
    per_rank = (config.get("train") or {}).get("global_batch_size")
    saved_per_rank = ((saved.get("config") or {}).get("train") or {}).get("global_batch_size", per_rank)
    if old == global_batch or saved_per_rank != per_rank:
        return []
    line = f"the global batch: {old} -> {global_batch} samples per step"
    if per_rank and old % per_rank == 0 and global_batch % per_rank == 0:
        line += (f" (train.scaling=weak: train.global_batch_size={per_rank} per data-parallel rank, "
                 f"dp {old // per_rank} -> {global_batch // per_rank})")
    if not force:
        raise ConfigError(
            f"resuming from {path} with settings that change the run (a resumed run must equal an "
            f"uninterrupted one):\n  {line}\nResume on the data-parallel size it was trained on, start a "
            "new run directory, or set train.resume_force=true to resume anyway")
    return [f"changed on resume (train.resume_force=true): {line}"]


def check_saved(saved: dict | None, config: dict, data: dict, force: bool, path,
                global_batch: int | None = None) -> list[str]:
    """A loaded checkpoint's saved config and data against this run's (`check`, `check_data`,
    `check_global_batch`). Every rank holds the same state and config, so all decide alike
    (no collective)."""
    if not saved:
        return []
    return (check(saved.get("config"), config, force, path)
            + check_global_batch(saved, config, global_batch, force, path)
            + check_data(saved.get("data"), data, force, path))
