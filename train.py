"""minddp's trainer: a small GPT (or MLP) on real text, data-parallel by hand.

One process:                 python train.py
N processes on this machine: torchrun --standalone --nproc_per_node=N train.py
Several nodes (run on every node, same command, HEAD = the first node's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
             --rdzv_endpoint=HEAD:29500 --rdzv_id=myjob train.py
Any key can be overridden: train.max_steps=50 model=mlp data=synthetic ddp.bucket_cap_mb=5

The global batch (train.global_batch_size sequences) is fixed; each rank runs
global / (micro_batch_size x dp) micro-batches per step, so the loss curve does
not depend on the number of processes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.nn import functional as F

from minddp import checkpoint, consistency, debug, timeline
from minddp import tensor_parallel as tp
from minddp.config import ConfigError, register, validate
from minddp.data import ShardedBatches, build_datasets, evaluate
from minddp.ddp import DistributedDataParallel
from minddp.dist import env_ranks, init_distributed, shutdown, wait_for_peers
from minddp.mesh import Mesh
from minddp.model import GPT, MLP, GPTConfig, MLPConfig
from minddp.signals import StopRequest
from minddp.tracking import NullTracker, Tracker

register()
log = logging.getLogger("minddp")


def build_model(m) -> torch.nn.Module:
    """The model for a `model=` config group (its schema is the model's own config + name)."""
    cls, cfg_cls = (GPT, GPTConfig) if m.name == "gpt" else (MLP, MLPConfig)
    return cls(cfg_cls(**{f.name: m[f.name] for f in dataclasses.fields(cfg_cls)}))


def build_optimizer(model, o):
    # no weight decay on biases, norms and other vectors (GPT-2 practice)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": other, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2))
    return opt


def lr_factor(step: int, o, max_steps: int) -> float:
    """Linear warmup, then cosine decay from lr to min_lr at max_steps (a factor of lr)."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps))
    return (o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))) / o.lr


def run_name(cfg, world_size: int, dims) -> str:
    return cfg.wandb.name or (f"{cfg.model.name}-ws{world_size}-dp{dims.dp}-tp{dims.tp}"
                              f"-mb{cfg.train.micro_batch_size}-cap{cfg.ddp.bucket_cap_mb or 25:g}")


def train(cfg: DictConfig, run_dir: str) -> None:
    t = cfg.train
    info = init_distributed(t.device, timeout_s=t.init_timeout_s)
    fingerprints = cfg.ddp.debug or os.environ.get("MINDDP_DEBUG") == "1"
    if t.flight_recorder or fingerprints:
        debug.enable(record=t.flight_recorder, fingerprints=fingerprints, timeout_s=t.timeout_s)
    derived = validate(cfg, info.world_size)
    dims, accum = derived["dims"], derived["accum"]
    mesh = Mesh.create(info.world_size, cfg.mesh.tp, info.device.type)
    if info.rank != 0:  # only rank 0 writes the log file; every rank still prints its errors
        logging.getLogger().handlers = [h for h in logging.getLogger().handlers
                                        if not isinstance(h, logging.FileHandler)]
        log.setLevel(logging.WARNING)

    torch.manual_seed(cfg.seed)  # same initial weights everywhere (and broadcast anyway)
    # built whole, then sliced: a tp=2 model starts from the tp=1 model's weights
    model = tp.parallelize_gpt(build_model(cfg.model), mesh.tp_group, mesh.tp_size, mesh.tp_rank) \
        if dims.tp_enabled else build_model(cfg.model)
    model = model.to(info.device)
    train_set, val_set = build_datasets(cfg.data, cfg.model.block_size)
    batches = ShardedBatches(train_set, mesh.dp_size, mesh.dp_rank, t.micro_batch_size, accum,
                             cfg.seed, info.device)
    ckpt_path, state = checkpoint.resolve(run_dir, t.resume, info.device)
    if state:  # checkpoints hold full tensors: any layout can resume any other
        try:
            tp.load_full_state_dict(model, state["model"], mesh.tp_size, mesh.tp_rank)
        except (RuntimeError, KeyError) as e:
            raise checkpoint.CheckpointError(
                f"checkpoint {ckpt_path} was written by a different model: {str(e).splitlines()[0]} "
                f"... Use the model config it was trained with, or train.resume=none") from None

    d = cfg.ddp
    ddp = DistributedDataParallel(model, process_group=mesh.dp_group, bucket_cap_mb=d.bucket_cap_mb,
                                  find_unused_parameters=d.find_unused_parameters,
                                  broadcast_buffers=d.broadcast_buffers, overlap=d.overlap,
                                  reduce_op=d.reduce_op, compress=d.compress, algorithm=d.algorithm,
                                  strict_bucket_cap=d.strict_bucket_cap)
    opt = build_optimizer(model, cfg.optim)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.optim, t.max_steps))
    start = 0
    if state:
        tp.load_full_optimizer_state(opt, state["optimizer"], mesh.tp_size, mesh.tp_rank)
        sched.load_state_dict(state["scheduler"])
        start = state["step"]
        torch.set_rng_state(state["rng"][info.rank % len(state["rng"])].cpu())

    name = run_name(cfg, info.world_size, dims)
    tracker = (Tracker(run_dir, OmegaConf.to_container(cfg, resolve=True), cfg.wandb, name,
                       t.max_steps, start, t.log_every) if info.is_main else NullTracker())
    full_params = sum(p.numel() * (mesh.tp_size if hasattr(p, "tp_shard") else 1) for p in model.parameters())
    tracker.info(f"{name}: {full_params / 1e6:.2f}M parameters, world {info.world_size} "
                 f"({info.backend} on {info.device.type}), dp {dims.dp} x tp {dims.tp}, "
                 f"accumulation {accum}, {len(ddp.bucket_assignment)} buckets, run dir {run_dir}"
                 + (f", resumed from {ckpt_path} at step {start}" if state else ""))

    # set up: from now on a collective that does not complete within train.timeout_s is an error
    for group in {None, mesh.dp_group, mesh.tp_group}:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=t.timeout_s), group)
    # SIGTERM/SIGUSR1: dump the flight recorder, checkpoint at the end of this step, then exit
    stop = StopRequest(on_signal=lambda: debug.dump(run_dir, "signal"))
    autocast = lambda: torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=t.bf16)  # noqa: E731
    tokens_per_step = t.global_batch_size * cfg.model.block_size
    step, skipped = start, 0
    try:
        for step in range(start + 1, t.max_steps + 1):
            tracer = timeline.StepTrace(ddp) if step == t.trace_step else None
            t0 = time.perf_counter()
            if tracer:
                tracer.start()
            loss_sum = torch.zeros((), device=info.device)
            micro = batches.get(step - 1)
            for m, (x, y) in enumerate(micro):
                # no_sync around forward *and* backward on all but the last micro-batch
                with ddp.no_sync() if m < accum - 1 else nullcontext():
                    ts = time.perf_counter()
                    with autocast():
                        logits = ddp(x)
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / accum
                    tb = time.perf_counter()
                    loss.backward()
                if tracer:
                    tracer.span(f"forward {m}", ts, tb)
                    tracer.span(f"backward {m}", tb, time.perf_counter())
                loss_sum += loss.detach()
            if step == t.fault_nan_step and info.rank == t.fault_nan_rank:
                # fault injection: as if this rank's loss and gradients blew up (after the reduction,
                # so only this rank sees it: stepping alone would silently split the replicas)
                loss_sum.fill_(float("nan"))
                next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))
            grad_norm = (tp.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, mesh.tp_group,
                                            mesh.tp_size) if cfg.optim.grad_clip > 0 else None)
            # One all-reduce decides for every rank together: the global loss (the mean over
            # data-parallel ranks, not rank 0's shard), whether someone was asked to stop, and
            # whether any rank saw a non-finite loss or gradient (then all skip or all stop).
            nonfinite = ~torch.isfinite(loss_sum) | (grad_norm is not None and ~torch.isfinite(grad_norm))
            flags = torch.stack([loss_sum, torch.tensor(float(stop.requested), device=info.device),
                                 nonfinite.float().to(info.device)])
            dist.all_reduce(flags, op=dist.ReduceOp.AVG)
            loss_value, stopping_by_signal, skip = flags[0].item(), flags[1].item() > 0, flags[2].item() > 0
            lr = sched.get_last_lr()[0]
            if skip:
                skipped += 1
                log.warning(f"step {step}: non-finite loss or gradient on some rank; all ranks "
                            f"{'skip this step' if t.on_nonfinite == 'skip' else 'stop'}")
            else:
                opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if tracer:  # a collective (every rank's trace to every rank), then rank 0 writes
                traces = {f"step {step}, overlap={d.overlap}": timeline.gather(tracer.stop())}
                if info.is_main:
                    tracer_files = timeline.write(traces, f"{run_dir}/trace_step{step}")
                    log.info(f"wrote {tracer_files[0]} and {tracer_files[1]}")
            dt = time.perf_counter() - t0
            s = ddp.comm_stats
            row = {"step": step, "loss": loss_value, "lr": lr, "step_time_s": dt,
                   "tokens_per_s": tokens_per_step / dt, "epoch": batches.position(step - 1)[0],
                   "comm/collectives": s.num_collectives, "comm/bytes": s.bytes,
                   "comm/time_s": s.comm_time_s, "comm/busy_s": s.busy_s,
                   "comm/exposed_wait_s": s.exposed_wait_s,
                   "comm/exposed_fraction": s.exposed_wait_s / dt}
            if grad_norm is not None:
                row["grad_norm"] = grad_norm.item()
            if skipped:
                row["skipped_steps"] = skipped
            if t.check_every and step % t.check_every == 0:
                consistency.check_replicas(model, mesh.dp_group)
            if (t.eval_every and step % t.eval_every == 0) or step == t.max_steps:
                row["val_loss"] = evaluate(model, val_set, mesh.dp_rank, mesh.dp_size, t.micro_batch_size,
                                           t.eval_samples, info.device, group=mesh.dp_group,
                                           autocast=autocast)
            tracker.log(row)
            if skip and t.on_nonfinite == "stop":
                raise FloatingPointError(f"non-finite loss or gradient at step {step} on some rank "
                                         "(train.on_nonfinite=stop); the last checkpoint is intact")
            stopping = stopping_by_signal or (t.stop_at_step is not None and step >= t.stop_at_step)
            if (t.ckpt_every and step % t.ckpt_every == 0) or step == t.max_steps or stopping:
                save_checkpoint(run_dir, step, model, opt, sched, batches, info, mesh, tracker)
            if stopping:
                why = "a stop signal" if stopping_by_signal else "train.stop_at_step"
                tracker.info(f"stopping after step {step} ({why}); resume with train.resume=auto")
                break
    finally:
        tracker.close()
    # leave together: a rank that tears down its process group while a peer is still in
    # a collective makes gloo's connection threads abort the peer at exit
    dist.barrier()


def save_checkpoint(run_dir, step, model, opt, sched, batches, info, mesh, tracker) -> None:
    # collectives first, on every rank (full tensors gathered over tp, RNG states), then rank 0 writes
    model_state = tp.full_state_dict(model, mesh.tp_group, mesh.tp_size)
    opt_state = tp.full_optimizer_state(opt, model, mesh.tp_group, mesh.tp_size)
    rng = [None] * info.world_size
    dist.all_gather_object(rng, torch.get_rng_state())
    if info.is_main:
        epoch, pos = batches.position(step)
        path = checkpoint.save(run_dir, step, {
            "model": model_state, "optimizer": opt_state, "scheduler": sched.state_dict(),
            "step": step, "epoch": epoch, "position_in_epoch": pos, "rng": rng})
        tracker.info(f"saved {path}")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = HydraConfig.get().runtime.output_dir
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    try:
        validate(cfg, env_ranks()[2])  # config errors before any process group starts
        train(cfg, run_dir)
    except ConfigError as e:  # bad input: a clear message and exit code 2 on every rank
        print(f"[rank {rank}] minddp: configuration error: {e}", file=sys.stderr, flush=True)
        wait_for_peers(f"minddp/config_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        shutdown()
        sys.exit(2)
    except BaseException as e:
        where = debug.dump(run_dir, f"{type(e).__name__}: {e}")
        hint = f"\n[rank {rank}] flight recorder: {where}; python -m minddp.debug {run_dir}" if where else ""
        print(f"[rank {rank}] minddp: {type(e).__name__}: {e}{hint}", file=sys.stderr, flush=True)
        raise
    finally:
        shutdown()


if __name__ == "__main__":
    main()
