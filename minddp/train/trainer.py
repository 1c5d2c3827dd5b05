"""The training loop, read top to bottom: setup, fit, train_step, log.

    Trainer(cfg, run_dir).fit()

One optimizer step (`train_step`, on one screen): forward and backward over the
micro-batches, with the gradient reduction only on the last (torch DDP's
`require_backward_grad_sync`, the way nanoGPT does it); the gradient norm (clipped); one small
all-reduce that decides for every rank together (the global loss, a stop request, a
non-finite loss or gradient): the step's one host read (logging steps add the metrics'); then
the optimizer. `fit` decides when to evaluate, check replicas, log and checkpoint. The
optimizer keeps minddp.optim's protocol whether it is replicated, sharded (ZeRO-1) or
overlapped, so the loop never asks which. The global batch is fixed (strong scaling), so the
loss curve does not depend on the number of processes; train.scaling=weak fixes each rank's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.nn import functional as F

from .. import _compat
from ..engine import transfer
from ..engine.ddp import DistributedDataParallel
from ..errors import ConfigError
from ..io.atomic import atomic_write
from ..model.build import build_model
from ..parallel import tensor_parallel as tp
from ..parallel.dist import env_ranks, init_distributed
from ..parallel.mesh import Mesh
from .build import build_optimizer, compile_model
from .checkpoint.manager import CheckpointManager
from .checkpoint.state import RunState
from .config import validate
from .data import ShardedBatches, load_data_agreed, record_in_config
from .evaluate import evaluate
from .io import lock
from .metrics import flight_recorder, flops, steptrace
from .metrics import identity as ident_
from .metrics.probe import StepProbe
from .metrics.straggler import spread
from .metrics.tracking import NullTracker, Tracker
from .resume.command import resume_command
from .safety import consistency
from .safety.faults import Faults
from .safety.guard import SkipGuard
from .safety.signals import StopRequest
from .safety.together import together

log = logging.getLogger("minddp")


@dataclass
class StepResult:
    loss: float  # mean over data-parallel ranks (NaN if some rank saw a non-finite value)
    grad_norm: torch.Tensor
    skipped: bool
    stop_requested: bool
    seconds: float = 0.0


class Trainer:
    def __init__(self, cfg, run_dir: str):
        self.cfg, self.t, self.run_dir = cfg, cfg.train, str(run_dir)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Each object once, in the order it depends on: settings, process group, mesh, data, model,
        wrapper, optimizer and schedule, the checkpoints (which resume into them), what measures
        and reports the run, the stop signal."""
        cfg, t = self.cfg, self.t
        detail = cfg.ddp.debug or flight_recorder.env_detail()
        derived, refused = None, None
        try:  # the settings, before any process group uses them
            derived = validate(cfg, env_ranks()[2])
            flight_recorder.configure(t.flight_recorder, self.run_dir, detail=detail)
        except ConfigError as e:  # a rank-local verdict (its env, its memory): agreed below
            refused = e
        self.info = info = init_distributed(t.device, timeout_s=t.init_timeout_s if refused is None else 600)
        together(refused)  # one collective: a setting one rank refuses stops every rank, naming it
        flops.set_tf32(t.tf32, info.device)  # train.tf32: torch's own process-wide flags, set here once
        lock.hold_agreed(self.run_dir, info.rank)  # one live job per run dir, before anything is written
        self.dims, self.accum, self.global_batch = derived["dims"], derived["accum"], derived["global_batch"]
        self.mesh = mesh = Mesh.create(info.world_size, cfg.mesh.tp, info.device.type)
        flight_recorder.register_groups(None, mesh.dp_group, mesh.tp_group)
        if info.rank != 0:  # only rank 0 writes the log file; every rank still prints its errors
            quiet_logging()
        self.train_set, self.val_set, self.data_info = load_data_agreed(cfg.data, cfg.model.block_size,
                                                                        cfg.model.vocab_size,
                                                                        cfg.model.get("init_from"))
        record_in_config(cfg, self.data_info)  # the saved config, run.json and W&B say what was used
        self.vocab_size = self.data_info.vocab_size
        self.model = self._build_model()
        self.batches = ShardedBatches(self.train_set, mesh.dp_size, mesh.dp_rank, t.micro_batch_size,
                                      self.accum, cfg.seed, info.device)
        self.ddp = self._wrap(self.model)
        self.opt = build_optimizer(self.model, cfg.optim, info.device, self.ddp, mesh.tp_group, mesh.tp_size)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt.optim, self.lr_factor)
        self.faults = Faults(t, info.rank)
        # the checkpoint goes into the objects it restores (a folder's tensors in place, each
        # rank its own part); a fresh run with model.init_from takes that folder's weights
        self.checkpoints = CheckpointManager(
            self.run_dir, t, RunState(self.model, self.opt, self.sched, self.batches, mesh, info.device,
                                      self.lr_factor),
            identity={"config": self.run_config(), "data": self.data_info.as_dict()}, model_cfg=cfg.model,
            vocab_size=self.vocab_size, global_batch=self.global_batch, pause=self.faults.pause)
        self.start = self.checkpoints.load()
        self.skipped = self.checkpoints.skipped_steps  # the run's count, across resumes
        self.guard = SkipGuard(t.max_skipped_steps, cfg.optim.lr, info.device, self.start,
                               self.checkpoints.path)
        self.tokens_per_step = self.global_batch * cfg.model.block_size  # weak scaling: grows with dp
        self.num_params = sum(p.numel() * (mesh.tp_size if hasattr(p, "tp_shard") else 1)
                              for p in self.model.parameters())  # the whole model's, over tp
        self.flops_per_token = flops.flops_per_token(cfg.model, self.num_params)
        self.bf16 = flops.autocast_bf16(t.bf16, info.device)
        self.job_peak_tflops = self._job_peak_tflops()
        self.tracker = self._make_tracker()
        for note in self.checkpoints.notes:  # what changed since the checkpoint, in the start-up output
            self.tracker.info(note)
        self.tracker.info(self.checkpoints.describe())
        self._window: list[StepResult] = []  # the steps since the last metrics row
        self._spread = {}  # the slowest rank, per check_every
        self.probe = StepProbe(self.ddp, self.faults, info.device, trace_step=t.trace_step,
                               run_dir=self.run_dir, overlap=cfg.ddp.overlap, rank=info.rank,
                               world=info.world_size)
        self.peak_rss_mb = 0.0  # every rank's peak, from the last step's agreement
        dump = lambda: flight_recorder.dump(self.run_dir, f"signal {self.stop.name}")  # noqa: E731
        self.stop = StopRequest(on_signal=dump)
        self._arm_timeout()

    def lr_factor(self, step: int) -> float:
        return lr_factor(step, self.cfg.optim, self.t.max_steps)  # the schedule, below the loop

    def run_config(self) -> dict:
        """The configuration a checkpoint saves, and a resume compares against."""
        return OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)

    def _build_model(self) -> torch.nn.Module:
        cfg, mesh = self.cfg, self.mesh
        torch.manual_seed(cfg.seed)  # same initial weights everywhere (and broadcast anyway)
        model = build_model(cfg.model, self.vocab_size)
        if self.dims.tp_enabled:  # built whole, then sliced: tp=2 starts from the tp=1 weights
            model = tp.parallelize_gpt(model, mesh.tp_group, mesh.tp_size, mesh.tp_rank)
        # dropout masks differ across data-parallel ranks, agree within a tp group
        torch.manual_seed(cfg.seed + 1 + mesh.dp_rank)
        return model.to(self.info.device)

    def _wrap(self, model) -> DistributedDataParallel:
        d = self.cfg.ddp
        compile_model(model, self.cfg.train.compile)  # in place: the same parameters and names
        return DistributedDataParallel(
            model, process_group=self.mesh.dp_group, bucket_cap_mb=d.bucket_cap_mb,
            find_unused_parameters=d.find_unused_parameters, forward_sync_buffers=d.broadcast_buffers,
            overlap=d.overlap, reduce_op=d.reduce_op, compress=d.compress, algorithm=d.algorithm,
            strict_bucket_cap=d.strict_bucket_cap, shard_optimizer=d.shard_optimizer,
            optimizer_overlap=d.optimizer_overlap)

    def _job_peak_tflops(self) -> float | None:
        """The job's peak for MFU: the sum over processes (each measured its own); None where a
        rank has none."""
        peak, _ = flops.peak_tflops(self.info.device, self.t.peak_tflops)
        peaks = torch.tensor([peak], dtype=torch.float64, device=self.info.device)
        dist.all_reduce(peaks)
        return peaks.item() if peaks.item() > 0 else None  # NaN: a rank without a peak

    def _make_tracker(self):
        cfg, info, t = self.cfg, self.info, self.t
        if not info.is_main:
            return NullTracker()
        ident = ident_.identity(cfg, info.world_size, self.dims, info.backend, info.device, self.num_params,
                                  self.accum, len(self.ddp.bucket_assignment))
        name = ident_.run_name(cfg, ident)
        config = self.run_config()
        tracker = Tracker(self.run_dir, {**config, "data_info": self.data_info.as_dict()}, cfg.wandb, name,
                          t.max_steps, self.start, t.log_every, identity=ident)
        write_run_info(self.run_dir, {  # what minddp.tools.report needs to compare runs
            **ident, "name": name, "peak_tflops_job": self.job_peak_tflops, "data": self.data_info.as_dict(),
            "config": config})
        onoff = lambda flag: "on" if flag else "off"  # noqa: E731
        tracker.info(  # two short lines: the layout and engine, then the data and where it goes
            f"{name}: {self.num_params / 1e6:.2f}M parameters, world {info.world_size} = dp {self.dims.dp} x "
            f"tp {self.dims.tp} ({info.backend}, {info.device.type}), accumulation {self.accum}, "
            f"{len(self.ddp.bucket_assignment)} buckets, ZeRO-1 {onoff(self.ddp.shard_optimizer)}, "
            f"optimizer overlap {onoff(self.ddp.optimizer_overlap)}, "
            f"{flops.peak_phrase(self.job_peak_tflops)}\n"
            f"  {self.data_info.summary()}; run dir {self.run_dir}"
            + (f"; resumed from {self.checkpoints.path} at step {self.start}" if self.start else ""))
        return tracker

    def _arm_timeout(self) -> None:
        """From now on a collective that does not complete within train.timeout_s is an error.
        The barrier first: a rank still in its slow start-up (imports, W&B) must not be
        timed out by the others' short timeout."""
        dist.barrier()
        for group in {None, self.mesh.dp_group, self.mesh.tp_group}:
            _compat.set_pg_timeout(self.t.timeout_s, group)

    # ------------------------------------------------------------------- loop
    def fit(self) -> None:
        profiler = steptrace.profiler(self.t.profile_steps, self.start, self.run_dir, self.info)
        try:
            for step in range(self.start + 1, self.t.max_steps + 1):
                if profiler is None:
                    stop = self.run_step(step)
                else:
                    with torch.profiler.record_function(f"minddp: step {step}"):
                        stop = self.run_step(step)
                    profiler.step()  # the trace's ProfilerStep# counts from 0
                if stop:
                    break
        finally:
            # first, nothing that could raise before it: a save in flight committed or removed, said
            self.checkpoints.end()
            if profiler:
                profiler.stop()
            if self.info.is_main:
                self.tracker.info(self.checkpoints.usage())
            self.tracker.close()
        if self.tracker.next_steps():  # rank 0, after W&B's own closing lines
            self.tracker.info(self.tracker.next_steps())
        # leave together: a rank that tears down its process group while a peer is still in
        # a collective makes gloo's connection threads abort the peer at exit
        dist.barrier()

    def run_step(self, step: int) -> bool:
        """A step and what follows it: check replicas, evaluate and log, checkpoint. True when
        the run should stop. Every rank decides alike (from the agreed result), so all run the
        same collectives."""
        t = self.t
        t0 = time.perf_counter()
        result = self.train_step(step)
        result.seconds = time.perf_counter() - t0
        self._window.append(result)
        if step == self.start + 1:  # a line on a non-terminal: the first metrics row may be minutes away
            self.tracker.first_step_done(step)
        stopping = result.stop_requested or (t.stop_at_step is not None and step >= t.stop_at_step)
        if t.check_every and step % t.check_every == 0:  # the step times ride on its all-gather
            self.opt.wait_params()
            times = consistency.check_replicas(self.model, self.mesh.dp_group, self.probe.clock.take())
            self._spread = spread(times)
        if self._should_log(step, result, stopping):
            val = (evaluate(self.model, self.val_set, self.mesh, t, self.info.device, self.autocast)
                   if self._eval_due(step) else None)
            self.log(step, self._window, val)
            self._window = []
        if result.skipped and t.on_nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss or gradient at step {step} on some rank "
                                     "(train.on_nonfinite=stop); the last checkpoint is intact")
        self.guard.after_step(step, result.skipped, self.model, self.opt)
        # a due save at the end, or train.ckpt_final's, is the run's last: in the foreground
        due = bool(t.ckpt_every) and step % t.ckpt_every == 0
        self.checkpoints.save(step, last=stopping or (step == t.max_steps and (t.ckpt_final or due)),
                              skipped_steps=self.skipped, nonfinite_streak=self.guard.in_a_row)
        if stopping:
            why = "a stop signal" if result.stop_requested else "train.stop_at_step"
            self.tracker.info(f"stopping after step {step} ({why}); resume with:\n  "
                              + resume_command(self.run_dir))
        return stopping

    def train_step(self, step: int) -> StepResult:
        """Micro-steps (the gradients reduced on the last), clip, agree, step, zero_grad. The
        instrumentation is the probe's (minddp.train.metrics.probe), at named points."""
        probe = self.probe
        probe.begin(step)
        loss_sum = torch.zeros((), device=self.info.device)
        for m, (x, y) in enumerate(self.batches.get(step - 1)):
            self.ddp.require_backward_grad_sync = m == self.accum - 1  # what no_sync() toggles
            with probe.forward(m), self.autocast():
                loss = F.cross_entropy(self.ddp(x).flatten(0, 1).float(), y.flatten()) / self.accum
            with probe.backward(m):
                loss.backward()
            loss_sum += loss.detach()
        probe.after_backward(step, self.model, loss_sum)
        clip = self.cfg.optim.grad_clip
        norm = self.opt.clip_grad_norm_(clip) if clip > 0 else self.opt.grad_norm()
        loss, stop, skip = self.agree(loss_sum, norm)  # the step's one host read
        if skip:
            log.warning(f"step {step}: non-finite loss or gradient on some rank; all ranks "
                        f"{'skip this step' if self.t.on_nonfinite == 'skip' else 'stop'}")
        else:
            self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        probe.end(step)
        return StepResult(loss, norm, skip, stop)

    def autocast(self):
        return torch.autocast(self.info.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def agree(self, loss_sum: torch.Tensor, norm: torch.Tensor) -> tuple[float, bool, bool]:
        """One all-reduce decides for every rank together: the global loss (the mean over
        data-parallel ranks, not rank 0's shard), whether someone was asked to stop, and
        whether any rank saw a non-finite loss or gradient (then all skip, or all stop).
        Each rank's peak memory rides along in its own slot (the probe's)."""
        nonfinite = ~torch.isfinite(loss_sum) | ~torch.isfinite(norm.to(self.info.device))
        host = transfer.to_device([float(self.stop.requested), *self.probe.memory_slot()],
                                  like=loss_sum)  # pinned, async
        flags = torch.cat([torch.stack([loss_sum, nonfinite.float()]), host])
        self.probe.arrive()
        dist.all_reduce(flags, op=dist.ReduceOp.AVG)
        values = flags.tolist()
        self.probe.settled()
        self.peak_rss_mb = max(values[3:])
        return values[0], values[2] > 0, values[1] > 0

    # ---------------------------------------------------------------- logging
    def _should_log(self, step: int, result: StepResult, stopping: bool) -> bool:
        t = self.t
        return (step % t.log_every == 0 or step == t.max_steps or stopping or result.skipped
                or self._eval_due(step))

    def _eval_due(self, step: int) -> bool:
        return bool(self.t.eval_every and step % self.t.eval_every == 0) or step == self.t.max_steps

    def log(self, step: int, window: list[StepResult], val_loss: float | None = None) -> None:
        """One metrics row for the steps since the last one (means over them)."""
        seconds = sum(r.seconds for r in window) / len(window)
        tokens_per_s = self.tokens_per_step / seconds
        tflops, mfu = flops.utilisation(tokens_per_s, self.flops_per_token, self.job_peak_tflops, 1)
        s, gather = self.ddp.comm_stats, self.opt.exposed_gather_s  # ZeRO-1's, else None
        self.skipped += sum(r.skipped for r in window)
        row = {"step": step, "loss": sum(r.loss for r in window) / len(window),
               "lr": self.sched.get_last_lr()[0], "step_time_s": seconds, "tokens_per_s": tokens_per_s,
               "tflops": tflops, "mfu": mfu, "epoch": self.batches.position(step - 1)[0],
               "samples_seen": self.batches.samples_seen(step),
               "grad_norm": window[-1].grad_norm.item(),
               "comm/collectives": s.num_collectives, "comm/bytes": s.bytes,
               "comm/time_s": s.comm_time_s, "comm/busy_s": s.busy_s,
               "comm/exposed_wait_s": s.exposed_wait_s, "comm/exposed_fraction": s.exposed_wait_s / seconds,
               "comm/exposed_gather_s": gather, "skipped_steps": self.skipped or None,
               "mem/peak_rss_mb": self.peak_rss_mb, "val_loss": val_loss,
               "machine/load_1min": os.getloadavg()[0],  # what else ran here: explains a slow row
               **self._spread}
        self._spread = {}
        self.tracker.log({k: v for k, v in row.items() if v is not None})


def lr_factor(step: int, o, max_steps: int) -> float:
    """The LR schedule (a factor of optim.lr): linear warmup, then cosine decay to min_lr at
    max_steps. Beside the loop, as nanoGPT's get_lr: LambdaLR calls it every step."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps))
    return (o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))) / o.lr


def write_run_info(run_dir: str, info: dict) -> None:
    atomic_write(Path(run_dir) / "run.json", json.dumps(info, indent=1))


def quiet_logging() -> None:
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, logging.FileHandler)]
    log.setLevel(logging.WARNING)
