"""The training loop, read top to bottom: setup, train_step, evaluate, save and load.

    Trainer(cfg, run_dir).fit()

One optimizer step (`train_step`): forward and backward over the micro-batches, with the
gradient reduction only on the last (torch DDP's `require_backward_grad_sync`, the way
nanoGPT does it); one small all-reduce that decides for every rank together (the global
loss, a stop request, a non-finite loss or gradient), which is the step's only host sync;
then the optimizer. The global batch is fixed, so the loss curve does not depend on the
number of processes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.nn import functional as F

from .. import _compat
from .. import tensor_parallel as tp
from ..ddp import DistributedDataParallel
from ..dist import init_distributed
from ..mesh import Mesh
from ..zero import OverlappedOptimizer, ShardedOptimizer
from . import checkpoint, consistency, flight_recorder, flops, resume, resume_check, steptrace
from .atomic import atomic_write
from .config import validate
from .data import ShardedBatches, collate, load_data_agreed, record_in_config
from .faults import Faults
from .guard import SkipGuard
from .model import GPT, MLP, GPTConfig, MLPConfig
from .signals import StopRequest
from .steptrace import StepTrace
from .tracking import NullTracker, Tracker

log = logging.getLogger("minddp")


def build_model(m, vocab_size: int) -> torch.nn.Module:
    """The model for a `model=` config group (its schema is the model's own config + name)."""
    cls, cfg_cls = (GPT, GPTConfig) if m.name == "gpt" else (MLP, MLPConfig)
    kwargs = {f.name: m[f.name] for f in dataclasses.fields(cfg_cls)}
    return cls(cfg_cls(**{**kwargs, "vocab_size": vocab_size}))


def build_optimizer(model, o, device: torch.device, ddp=None):
    """AdamW, fused where torch has the kernel (CPU and CUDA: one pass over all parameters);
    no weight decay on biases, norms and other vectors (GPT-2 practice). With a sharding
    engine (ddp.shard_optimizer), the same AdamW runs on this rank's shard (ZeRO-1)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": other, "weight_decay": 0.0}]
    kwargs = {"lr": o.lr, "betas": (o.beta1, o.beta2),
              "fused": device.type in ("cpu", "cuda")}  # where torch has the kernel
    if ddp is not None and ddp.shard_optimizer:
        return ShardedOptimizer(ddp, torch.optim.AdamW, groups, **kwargs)
    if ddp is not None and ddp.optimizer_overlap:  # stepped bucket by bucket inside backward
        return OverlappedOptimizer(ddp, torch.optim.AdamW, groups, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lr_factor(step: int, o, max_steps: int) -> float:
    """Linear warmup, then cosine decay from lr to min_lr at max_steps (a factor of lr)."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps))
    return (o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))) / o.lr


def run_name(cfg, world_size: int, dims) -> str:
    return cfg.wandb.name or (f"{cfg.model.name}-ws{world_size}-dp{dims.dp}-tp{dims.tp}"
                              f"-mb{cfg.train.micro_batch_size}-cap{cfg.ddp.bucket_cap_mb or 25:g}")


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
        cfg, t = self.cfg, self.t
        detail = cfg.ddp.debug or flight_recorder.env_detail()
        flight_recorder.configure(t.flight_recorder, self.run_dir, detail=detail)
        self.info = info = init_distributed(t.device, timeout_s=t.init_timeout_s)
        derived = validate(cfg, info.world_size)
        self.dims, self.accum = derived["dims"], derived["accum"]
        self.mesh = mesh = Mesh.create(info.world_size, cfg.mesh.tp, info.device.type)
        flight_recorder.register_groups(None, mesh.dp_group, mesh.tp_group)
        if info.rank != 0:  # only rank 0 writes the log file; every rank still prints its errors
            quiet_logging()
        self.train_set, self.val_set, self.data_info = load_data_agreed(cfg.data, cfg.model.block_size,
                                                                        cfg.model.vocab_size)
        record_in_config(cfg, self.data_info)  # the saved config, run.json and W&B say what was used
        self.vocab_size = self.data_info.vocab_size
        self.model = self._build_model()
        self.batches = ShardedBatches(self.train_set, mesh.dp_size, mesh.dp_rank, t.micro_batch_size,
                                      self.accum, cfg.seed, info.device)
        self.ckpt_path, state = checkpoint.resolve_agreed(
            self.run_dir, t.resume, info.device, resume.shape_check(cfg.model, build_model, self.vocab_size))
        resume_notes = self._check_resume(state)
        self._load_model(state)
        self.ddp = self._wrap(self.model)
        self.opt = build_optimizer(self.model, cfg.optim, info.device, self.ddp)
        self.sched = torch.optim.lr_scheduler.LambdaLR(  # on the inner optimizer when sharded
            getattr(self.opt, "optim", self.opt), lambda s: lr_factor(s, cfg.optim, t.max_steps))
        self.start = self._load_training_state(state)
        self._setup_throughput()
        self.tracker = self._make_tracker()
        for note in resume_notes:  # what changed since the checkpoint, in the start-up output
            self.tracker.info(note)
        self._window, self.skipped, self.guard = [], 0, SkipGuard(t.max_skipped_steps)
        self.faults = Faults(t, info.rank)
        dump = lambda: flight_recorder.dump(self.run_dir, f"signal {self.stop.name}")  # noqa: E731
        self.stop = StopRequest(on_signal=dump)
        self._arm_timeout()

    def run_config(self) -> dict:
        """The configuration a checkpoint saves, and a resume compares against."""
        return OmegaConf.to_container(self.cfg, resolve=True)

    def _check_resume(self, state) -> list[str]:
        """Refuse changed settings that break an exact resume; list the applied ones. Every
        rank holds the same state and config, so all decide alike (no collective)."""
        if not state:
            return []
        force, path = self.t.resume_force, self.ckpt_path
        return (resume_check.check(state.get("config"), self.run_config(), force, path)
                + resume_check.check_data(state.get("data"), self.data_info.as_dict(), force, path))

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
        return DistributedDataParallel(
            model, process_group=self.mesh.dp_group, bucket_cap_mb=d.bucket_cap_mb,
            find_unused_parameters=d.find_unused_parameters, broadcast_buffers=d.broadcast_buffers,
            overlap=d.overlap, reduce_op=d.reduce_op, compress=d.compress, algorithm=d.algorithm,
            strict_bucket_cap=d.strict_bucket_cap, shard_optimizer=d.shard_optimizer,
            optimizer_overlap=d.optimizer_overlap)

    def _setup_throughput(self) -> None:
        """Tokens per step, FLOPs per token and the device peak, for tokens/s, TFLOP/s and MFU."""
        t, mesh = self.t, self.mesh
        self.tokens_per_step = t.global_batch_size * self.cfg.model.block_size
        self.num_params = full = sum(p.numel() * (mesh.tp_size if hasattr(p, "tp_shard") else 1)
                                     for p in self.model.parameters())
        self.flops_per_token = flops.flops_per_token(self.cfg.model, full)
        self.bf16 = flops.set_precision(t.bf16, self.info.device)
        peak, self.peak_source = flops.peak_tflops(self.info.device, t.peak_tflops)
        peaks = torch.tensor([peak], dtype=torch.float64, device=self.info.device)
        dist.all_reduce(peaks)  # the job's peak: the sum over processes (each measured its own)
        self.job_peak_tflops = peaks.item()  # MFU is None (not logged) where it would exceed 100%

    def _make_tracker(self):
        cfg, info, t = self.cfg, self.info, self.t
        if not info.is_main:
            return NullTracker()
        name = run_name(cfg, info.world_size, self.dims)
        config = OmegaConf.to_container(cfg, resolve=True)
        tracker = Tracker(self.run_dir, {**config, "data_info": self.data_info.as_dict()}, cfg.wandb, name,
                          t.max_steps, self.start, t.log_every)
        write_run_info(self.run_dir, {  # what minddp.tools.report needs to compare runs
            "world_size": info.world_size, "dp": self.dims.dp, "tp": self.dims.tp, "backend": info.backend,
            "device": info.device.type, "num_params": self.num_params, "accumulation": self.accum,
            "peak_tflops_job": self.job_peak_tflops, "data": self.data_info.as_dict(), "config": config})
        onoff = lambda flag: "on" if flag else "off"  # noqa: E731
        tracker.info(  # two short lines: the layout and engine, then the data and where it goes
            f"{name}: {self.num_params / 1e6:.2f}M parameters, world {info.world_size} = dp {self.dims.dp} x "
            f"tp {self.dims.tp} ({info.backend}, {info.device.type}), accumulation {self.accum}, "
            f"{len(self.ddp.bucket_assignment)} buckets, ZeRO-1 {onoff(self.ddp.shard_optimizer)}, "
            f"optimizer overlap {onoff(self.ddp.optimizer_overlap)}, "
            f"peak {self.job_peak_tflops:.3g} TFLOP/s\n"
            f"  {self.data_info.summary()}; run dir {self.run_dir}"
            + (f"; resumed from {self.ckpt_path} at step {self.start}" if self.start else ""))
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
        self._window: list[StepResult] = []
        profiler = self._profiler()
        try:
            for step in range(self.start + 1, self.t.max_steps + 1):
                if profiler:  # the training step's number in the trace (ProfilerStep# counts from 0)
                    with torch.profiler.record_function(f"minddp: step {step}"):
                        stop = self.run_step(step)
                    profiler.step()
                else:
                    stop = self.run_step(step)
                if stop:
                    break
        finally:
            if profiler:
                profiler.stop()
            self.tracker.close()
        if self.tracker.next_steps():  # rank 0, after W&B's own closing lines
            self.tracker.info(self.tracker.next_steps())
        # leave together: a rank that tears down its process group while a peer is still in
        # a collective makes gloo's connection threads abort the peer at exit
        dist.barrier()

    def _profiler(self):
        """train.profile_steps=[a,b]: a torch.profiler trace of steps a..b on every rank, in
        <run dir>/profile/ (TensorBoard's trace handler: open with TensorBoard or Perfetto)."""
        if not self.t.profile_steps:
            return None
        first, last = self.t.profile_steps
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.info.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        skip = max(0, first - 1 - self.start)
        prof = torch.profiler.profile(
            activities=activities, record_shapes=True,
            schedule=torch.profiler.schedule(skip_first=skip, wait=0, warmup=0, active=last - first + 1,
                                             repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                f"{self.run_dir}/profile", worker_name=f"rank{self.info.rank}"))
        prof.start()
        return prof

    def run_step(self, step: int) -> bool:
        """One step as the loop runs it: train, log, checkpoint. True when the run should stop."""
        t = self.t
        t0 = time.perf_counter()
        result = self.train_step(step)
        result.seconds = time.perf_counter() - t0
        self._window.append(result)
        stopping = result.stop_requested or (t.stop_at_step is not None and step >= t.stop_at_step)
        if self._should_log(step, result, stopping):
            self.log(step, self._window)
            self._window = []
        if result.skipped and t.on_nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss or gradient at step {step} on some rank "
                                     "(train.on_nonfinite=stop); the last checkpoint is intact")
        self.guard.after_step(step, result.skipped, self)
        if (t.ckpt_every and step % t.ckpt_every == 0) or step == t.max_steps or stopping:
            self.save(step)
        if stopping:
            why = "a stop signal" if result.stop_requested else "train.stop_at_step"
            self.tracker.info(f"stopping after step {step} ({why}); resume with:\n  "
                              + resume.resume_command(self.run_dir))
        return stopping

    def train_step(self, step: int) -> StepResult:
        """Forward and backward over this rank's micro-batches, then the optimizer step."""
        flight_recorder.set_context(step=step, phase="forward/backward")
        tracer = StepTrace(self.ddp) if step == self.t.trace_step else None
        if tracer:
            tracer.start()
        loss_sum = self.forward_backward(self.batches.get(step - 1), tracer)
        self.faults.after_backward(step, self.model, loss_sum)
        flight_recorder.set_context(phase="optimizer")
        norm = self.grad_norm()
        loss, stop, skip = self.agree(loss_sum, norm)
        if skip:
            log.warning(f"step {step}: non-finite loss or gradient on some rank; all ranks "
                        f"{'skip this step' if self.t.on_nonfinite == 'skip' else 'stop'}")
        else:
            self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if tracer:
            self._write_trace(step, tracer)
        return StepResult(loss, norm, skip, stop)

    def forward_backward(self, micro_batches, tracer=None) -> torch.Tensor:
        """Sum of the micro-batch losses (each divided by accum), left on the device."""
        loss_sum = torch.zeros((), device=self.info.device)
        for m, (x, y) in enumerate(micro_batches):
            # reduce only on the last micro-batch: the attribute no_sync() toggles
            self.ddp.require_backward_grad_sync = m == self.accum - 1
            ts = time.perf_counter()
            with self.autocast():
                logits = self.ddp(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / self.accum
            tb = time.perf_counter()
            loss.backward()
            if tracer:
                tracer.span(f"forward {m}", ts, tb)
                tracer.span(f"backward {m}", tb, time.perf_counter())
            loss_sum += loss.detach()
        self.ddp.require_backward_grad_sync = True
        return loss_sum

    def autocast(self):
        return torch.autocast(self.info.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm (clipped to optim.grad_clip if > 0), also the non-finite check."""
        mesh, clip = self.mesh, self.cfg.optim.grad_clip
        if self.ddp.shard_optimizer:  # each rank holds its shard of the gradients
            if clip > 0:
                return self.opt.clip_grad_norm_(clip, mesh.tp_group, mesh.tp_size)
            return self.opt.grad_norm(mesh.tp_group, mesh.tp_size)
        if mesh.tp_size == 1:  # straight from the engine's flat buffers: a kernel per bucket
            return self.ddp.clip_grad_norm_(clip) if clip > 0 else self.ddp.grad_norm()
        params = list(self.model.parameters())
        if clip > 0:
            return tp.clip_grad_norm_(params, clip, mesh.tp_group, mesh.tp_size)
        return tp.grad_norm(params, mesh.tp_group, mesh.tp_size)

    def agree(self, loss_sum: torch.Tensor, norm: torch.Tensor) -> tuple[float, bool, bool]:
        """One all-reduce decides for every rank together: the global loss (the mean over
        data-parallel ranks, not rank 0's shard), whether someone was asked to stop, and
        whether any rank saw a non-finite loss or gradient (then all skip, or all stop).
        Each rank's peak memory rides along in its own slot (the sum then holds them all)."""
        dev, world = self.info.device, self.info.world_size
        nonfinite = ~torch.isfinite(loss_sum) | ~torch.isfinite(norm.to(dev))
        rss = torch.zeros(world, device=dev)
        rss[self.info.rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 * world  # MiB
        host = torch.tensor([float(self.stop.requested)], device=dev)
        flags = torch.cat([torch.stack([loss_sum, nonfinite.float()]), host, rss])
        dist.all_reduce(flags, op=dist.ReduceOp.AVG)
        values = flags.tolist()  # the step's one host sync
        self.peak_rss_mb = max(values[3:])
        return values[0], values[2] > 0, values[1] > 0

    # ---------------------------------------------------------------- logging
    def _should_log(self, step: int, result: StepResult, stopping: bool) -> bool:
        t = self.t
        return (step % t.log_every == 0 or step == t.max_steps or stopping or result.skipped
                or self._eval_due(step))

    def _eval_due(self, step: int) -> bool:
        return bool(self.t.eval_every and step % self.t.eval_every == 0) or step == self.t.max_steps

    def log(self, step: int, window: list[StepResult]) -> None:
        """One metrics row for the steps since the last one (means over them); evaluation and
        the replica check run here too, on every rank (they are collectives)."""
        seconds = sum(r.seconds for r in window) / len(window)
        tokens_per_s = self.tokens_per_step / seconds
        tflops, mfu = flops.utilisation(tokens_per_s, self.flops_per_token, self.job_peak_tflops, 1)
        s = self.ddp.comm_stats
        row = {"step": step, "loss": sum(r.loss for r in window) / len(window),
               "lr": self.sched.get_last_lr()[0], "step_time_s": seconds, "tokens_per_s": tokens_per_s,
               "tflops": tflops, **({"mfu": mfu} if mfu is not None else {}),
               "epoch": self.batches.position(step - 1)[0],
               "samples_seen": self.batches.samples_seen(step),
               "grad_norm": window[-1].grad_norm.item(),
               "comm/collectives": s.num_collectives, "comm/bytes": s.bytes,
               "comm/time_s": s.comm_time_s, "comm/busy_s": s.busy_s,
               "comm/exposed_wait_s": s.exposed_wait_s, "comm/exposed_fraction": s.exposed_wait_s / seconds}
        if isinstance(self.opt, ShardedOptimizer):  # the last forward's wait for ZeRO-1's all-gathers
            row["comm/exposed_gather_s"] = self.opt.exposed_gather_s
        self.skipped += sum(r.skipped for r in window)
        if self.skipped:
            row["skipped_steps"] = self.skipped
        if self.t.check_every and step % self.t.check_every == 0:
            self._wait_params()
            consistency.check_replicas(self.model, self.mesh.dp_group)
        row["mem/peak_rss_mb"] = self.peak_rss_mb
        if self._eval_due(step):
            row["val_loss"] = self.evaluate()
        self.tracker.log(row)

    def _write_trace(self, step: int, tracer: StepTrace) -> None:
        # a collective (every rank's trace to every rank), then rank 0 writes
        traces = {f"step {step}, overlap={self.cfg.ddp.overlap}": steptrace.gather(tracer.stop())}
        if self.info.is_main:
            files = steptrace.write(traces, f"{self.run_dir}/trace_step{step}")
            log.info(f"wrote {files[0]} and {files[1]}")

    # ------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> float:
        """Exact mean token loss over the first train.eval_samples validation windows (all
        if 0), for any dp size: rank r takes windows r, r+dp, ... (no padding, nothing
        counted twice); sums and counts are all-reduced. The unwrapped model is used, so
        ranks may run different numbers of batches."""
        flight_recorder.set_context(phase="evaluate")
        t, mesh, dev, model = self.t, self.mesh, self.info.device, self.model
        n = len(self.val_set) if t.eval_samples <= 0 else min(len(self.val_set), t.eval_samples)
        mine = list(range(mesh.dp_rank, n, mesh.dp_size))
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=dev)
        for s in range(0, len(mine), t.micro_batch_size):
            x, y = collate(self.val_set, mine[s : s + t.micro_batch_size], dev)
            with self.autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
            total += torch.stack([loss.double(), torch.tensor(y.numel(), dtype=torch.float64, device=dev)])
        dist.all_reduce(total, group=mesh.dp_group)
        model.train()
        return (total[0] / total[1]).item()

    # ------------------------------------------------------------ checkpoints
    def save(self, step: int) -> None:
        """Collectives first, on every rank (full tensors gathered over tp, RNG states), then
        rank 0 writes atomically. Positions are global (samples seen), so any dp can resume."""
        flight_recorder.set_context(phase="checkpoint")
        self._wait_params()
        mesh = self.mesh
        model_state = tp.full_state_dict(self.model, mesh.tp_group, mesh.tp_size)
        opt_state = tp.full_optimizer_state(self.opt, self.model, mesh.tp_group, mesh.tp_size)
        rng = [None] * self.info.world_size
        dist.all_gather_object(rng, rng_state(self.info.device))
        failure, error = [None], None
        if self.info.is_main:
            epoch, pos = self.batches.position(step)
            try:
                path = checkpoint.save(self.run_dir, step, {
                    "model": model_state, "optimizer": opt_state, "scheduler": self.sched.state_dict(),
                    "step": step, "epoch": epoch, "position_in_epoch": pos,
                    "samples_seen": self.batches.samples_seen(step), "rng": rng,
                    "config": self.run_config(), "data": self.data_info.as_dict()})
                self.tracker.info(f"saved {path}")
            except Exception as e:  # noqa: BLE001 - every rank stops with it, none waits for rank 0
                failure, error = [f"{type(e).__name__}: {e}"], e
        dist.broadcast_object_list(failure, src=0)
        if error is not None:
            raise error
        if failure[0]:
            raise checkpoint.CheckpointWriteError(f"rank 0 could not save step {step}: {failure[0]}")

    def load(self, path) -> int:
        """Load a checkpoint into this set-up trainer (written at any dp/tp layout, sharded or
        not): model, optimizer, schedule and RNG. Every rank calls it; returns its step."""
        state = checkpoint.load(path, self.info.device)
        self.ckpt_path = Path(path)
        self._wait_params()
        self._load_model(state)
        self.start = self._load_training_state(state)
        return self.start

    def _wait_params(self) -> None:
        """Under ZeRO-1 the updated parameters arrive by all-gather: read them after it lands."""
        if hasattr(self.opt, "wait_params"):
            self.opt.wait_params()

    def _load_model(self, state) -> None:
        if not state:  # checkpoints hold full tensors: any layout can resume any other
            return
        try:
            tp.load_full_state_dict(self.model, state["model"], self.mesh.tp_size, self.mesh.tp_rank)
        except (RuntimeError, KeyError) as e:
            raise checkpoint.CheckpointError(
                f"checkpoint {self.ckpt_path} was written by a different model: "
                f"{str(e).splitlines()[0]} ... Use the model config it was trained with, "
                "or train.resume=none") from None

    def _load_training_state(self, state) -> int:
        if not state:
            return 0
        inner = getattr(self.opt, "optim", self.opt)
        settings = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        tp.load_full_optimizer_state(self.opt, state["optimizer"], self.mesh.tp_size, self.mesh.tp_rank)
        for group, mine in zip(inner.param_groups, settings):  # this run's optim.*, not the saved ones
            group.update(mine)
        self._restore_schedule(state["scheduler"]["last_epoch"])
        set_rng_state(state["rng"][self.info.rank % len(state["rng"])], self.info.device)
        return state["step"]


    def _restore_schedule(self, position: int) -> None:
        """Only the position comes from the checkpoint; the schedule is this run's optim.* and
        max_steps (LambdaLR's saved state would bring back the old optim.lr)."""
        self.sched.last_epoch = position
        factor = lr_factor(position, self.cfg.optim, self.t.max_steps)
        for group, base in zip(getattr(self.opt, "optim", self.opt).param_groups, self.sched.base_lrs):
            group["lr"] = base * factor


def write_run_info(run_dir: str, info: dict) -> None:
    atomic_write(Path(run_dir) / "run.json", json.dumps(info, indent=1))


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device: torch.device) -> None:
    if isinstance(state, torch.Tensor):  # checkpoints before CUDA states were saved
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def quiet_logging() -> None:
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, logging.FileHandler)]
    log.setLevel(logging.WARNING)
