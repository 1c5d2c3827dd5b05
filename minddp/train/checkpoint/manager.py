"""A run's checkpoints, owned by one object (torchtitan's CheckpointManager is the model): what a
save holds (the run's Stateful `RunState`, its identity, its counters), when a save is due, in
which format, in the background or not, which older ones go (retention), how a save in flight
ends with the run, and the load: which checkpoint resumes (chosen together by every rank,
falling back past damage, the config checked by resume/check.py), read in place into each rank's own
tensors, or the model.init_from weights for a fresh run.

    checkpoints = CheckpointManager(run_dir, cfg.train, RunState(...), identity={"config", "data"},
                                    model_cfg=cfg.model, vocab_size=..., global_batch=..., pause=...)
    start = checkpoints.load()                every rank, once, at setup: the step resumed from
    checkpoints.save(step, last, **counters)  every rank, after each step
    checkpoints.end()                         every rank, on any way out (an error included)
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch.distributed as dist

from ...model.build import build_model
from .. import init_from
from ..metrics import flight_recorder
from ..resume import check as resume_check
from ..safety.together import together
from . import store
from .choice import resolve_agreed, shape_check
from .errors import CheckpointError
from .folders import FOLDER, BackgroundSave
from .formats import FORMATS, STREAK, background_saves, saved_healthy
from .retention import Retention

log = logging.getLogger("minddp")


class CheckpointManager:
    def __init__(self, run_dir, t, state, *, identity: dict | None = None, model_cfg=None,
                 vocab_size: int | None = None, global_batch: int | None = None, pause=None):
        """Every rank, at start-up. `t`: train.* (resume, resume_force, ckpt_*, timeout_s);
        `state`: the run's RunState (state_dict, read_in_place, load_state_dict, device);
        `identity`: the config and data a save records and a resume compares; `model_cfg`,
        `vocab_size`: the shape check and model.init_from (None: neither); `pause(where, step)`:
        fault injection."""
        self.run_dir, self.t, self.state = run_dir, t, state
        self.identity = identity or {"config": {}, "data": {}}
        self.model_cfg, self.vocab_size, self.global_batch = model_cfg, vocab_size, global_batch
        self.every = t.ckpt_every
        self.fmt = FORMATS[str(t.ckpt_format)]
        self.background, self._why_background = background_saves(t.ckpt_async, self.fmt.name,
                                                                  state.device.type)
        self.retention = Retention.of(t.ckpt_keep, t.ckpt_keep_every)
        self.pause = pause or (lambda where, step: None)
        self.pending: BackgroundSave | None = None  # written beside the current step
        self._pending_healthy = True
        self.path = None  # the checkpoint this run resumed from (load)
        self.notes: list[str] = []  # what changed since it: resume/check.py's lines
        self.bytes_read = 0  # by this rank, reading its part in place
        self.skipped_steps = 0  # steps skipped as non-finite before the checkpoint (the run's count)
        self._counted: dict[str, bool] = {}  # checkpoint name -> whether it counts toward ckpt_keep
        self._check_writable()
        if dist.get_rank() == 0 and (caveat := self.retention.caveat(self.every)):
            log.warning(caveat)

    def _check_writable(self) -> None:
        """Every rank: a checkpoints folder this run cannot write is one line at start-up (exit 2
        on every rank), not an error at the first save. Every rank writes a folder's files;
        rank 0 alone a file."""
        error = None
        if self.fmt.name == "dcp" or dist.get_rank() == 0:
            error = store.write_problem(self.run_dir)
        together(None if error is None else CheckpointError(error), kinds=(CheckpointError, CheckpointError))

    def describe(self) -> str:
        """The start-up line: format, when, foreground or background and why, what is kept."""
        when = (f"every {self.every} steps and at the end" if self.every > 1 else
                "every step" if self.every else "at the end only")
        kind = ("dcp folders (each rank writes its part)" if self.fmt.name == "dcp"
                else "files (rank 0 writes)")
        where = "in the background" if self.background else "in the step"
        final = "" if self.t.get("ckpt_final", True) else \
            "; none at max_steps unless ckpt_every is due (ckpt_final=false)"
        return (f"checkpoints: {kind} {when}, written {where} ({self._why_background}); "
                f"{self.retention.describe()}{final}")

    # ------------------------------------------------------------------------- load
    def load(self) -> int:
        """Every rank, once: train.resume's checkpoint into the run's state (rank 0's choice,
        agreed; the config checked before any tensor is read; a folder read in place, each rank
        its part; a damaged one skipped for an older one where resume allows), else model.init_from
        for a fresh run. Returns the step resumed from (0: fresh)."""
        fits = None if self.model_cfg is None else shape_check(self.model_cfg, build_model, self.vocab_size)
        self.path, saved = resolve_agreed(self.run_dir, self.t.resume, self.state.device, fits,
                                          into=self._read_in_place, check=self._check_config)
        fresh = saved is None
        self.skipped_steps = (saved or {}).get("skipped_steps", 0)
        start = self.state.load_state_dict(saved, self.path)
        del saved
        _return_freed_heap()  # the read's buffers are gone: the steps that follow start from training's RSS
        self._init_from(fresh=fresh)
        # newer than the resumed step: skipped by the resume (corrupt) or left behind by it; none
        # counts toward train.ckpt_keep until this run saves its step again
        self._counted = {p.name: False for p in store.all_checkpoints(self.run_dir)
                         if (store.step_of(p) or 0) > start}
        return start

    def _check_config(self, path, saved) -> None:
        """A changed config is refused before anything is read (an error, not a fallback)."""
        self.notes = resume_check.check_saved(saved, self.identity["config"], self.identity["data"],
                                              self.t.resume_force, path, self.global_batch)

    def _read_in_place(self, path, saved) -> None:
        self.bytes_read = self.state.read_in_place(path, saved)

    def _init_from(self, fresh: bool) -> None:
        """model.init_from: a fresh run starts from its weights, a resumed one from its checkpoint."""
        folder = self.model_cfg.get("init_from") if self.model_cfg is not None else None
        if folder and fresh:
            init_from.load_agreed(self.state.model, self.model_cfg, self.vocab_size, self.state.mesh)
        elif folder:
            log.info(f"model.init_from={folder} not read: resumed from {self.path}")

    # ------------------------------------------------------------------------- save
    def save(self, step: int, last: bool = False, **counters) -> None:
        """Every rank, after a step: commit the save written beside it, then save if one is due
        (in the background unless it is the run's last), then rank 0 applies retention to what
        is committed. `counters`: the run's own (skipped_steps, nonfinite_streak: a save inside
        a non-finite streak takes no ckpt_keep slot)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None  # a failed commit is over too (removed, said)
            self._committed(pending.commit(), pending.step, self._pending_healthy)
        if not ((self.every and step % self.every == 0) or last):
            return
        healthy = not counters.get(STREAK)
        folder = self.fmt is FOLDER
        flight_recorder.set_context(phase="checkpoint")
        everything = {**self.state.state_dict(step, folder), **self.identity, **counters}
        if folder and self.background and not last:
            self.pending = FOLDER.save_in_background(
                self.run_dir, step, everything, timeout_s=self.t.timeout_s,
                before_write=lambda: self.pause("checkpoint_write", step))
            self._pending_healthy = healthy
        else:
            self._committed(self.fmt.save(self.run_dir, step, everything), step, healthy)

    def _counts(self, path) -> bool:
        """Whether a checkpoint counts toward train.ckpt_keep (retention.py): this run's saves
        and what its resume left behind are known; any other is read once."""
        name = Path(path).name
        if name not in self._counted:
            self._counted[name] = saved_healthy(path)
        return self._counted[name]

    def _committed(self, path, step: int, healthy: bool = True) -> None:
        """After the collective that agreed every rank's part of `path` is written: rank 0 alone
        deletes what retention no longer keeps."""
        if dist.get_rank() != 0:
            return
        log.info(f"saved {path}")
        self._counted[Path(path).name] = healthy
        pause = lambda: self.pause("checkpoint_delete", step)  # noqa: E731
        try:
            deleted = self.retention.apply(self.run_dir, path, pause, self._counts)
        except Exception as e:  # noqa: BLE001 - rank 0 alone, after the last collective: never raise here
            log.warning(f"retention: nothing deleted after {Path(path).name} "
                        f"({type(e).__name__}: {e}); every checkpoint is kept and the run goes on")
            return
        if deleted:
            log.info(f"removed {', '.join(p.name for p in deleted)} ({self.retention.describe()})")

    def end(self) -> None:
        """On a way out that is not the loop's own end (an error): the save in flight completed
        and committed, or removed, said in one line; never left running into the process's
        teardown, which aborts (SIGABRT) under a thread inside a collective."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        line = pending.end(self.t.timeout_s)
        if line:
            log.info(line)

    def usage(self) -> str:
        """The run's end: what its checkpoints are and take on disk."""
        found = store.all_checkpoints(self.run_dir)
        steps = ", ".join(str(store.step_of(p)) for p in found[:6]) + (", ..." if len(found) > 6 else "")
        return (f"checkpoints: {len(found)} in {store.checkpoint_dir(self.run_dir)}"
                + (f" (steps {steps})" if found else "")
                + f", {store.disk_bytes(self.run_dir) / 2**20:.1f} MiB on disk")


def _return_freed_heap() -> None:
    """glibc keeps what was freed on its heap (and after large frees raises its mmap threshold, so
    later tensors come from that heap too): give it back once a checkpoint's read buffers are gone,
    so a resumed run peaks where training does, not there plus the read. A no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)
