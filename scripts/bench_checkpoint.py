"""What a checkpoint costs the step, and rank 0's memory while it is written.

    torchrun --standalone --nproc_per_node=2 scripts/bench_checkpoint.py --out docs/bench_checkpoint.md

The trainer itself (a GPT of about 50M parameters, dp 2, ZeRO-1 on by default) runs steps; in
each round every variant saves once after a step, in rotated order, so the ratios come from one
run on one machine state:
  file          minddp's train.ckpt_format=file (checkpoint/manager.py's save): ZeRO-1 state all-gathered
                onto every rank, rank 0 writes one torch.save while the others wait
  folder        minddp's train.ckpt_format=dcp: each rank writes what it holds through
                torch.distributed.checkpoint (its ZeRO-1 parts; the replicated model split
                between ranks by DCP's dedup), plus the small state, checksums and the commit
  folder-async  the same with train.ckpt_async=true: written beside the next step, committed
                after it (the next step's time includes the commit, as in the trainer)
  dcp           bare torch.distributed.checkpoint.save of the same tensors (no checksums, no
                commit): what the folder format adds on top of DCP
Reported per variant: the checkpoint step over a normal step (medians and min-max over
rounds), the next step's time over a normal one, and each rank's peak RSS above its level
before the save (VmRSS sampled every 2 ms). On the CPU each rank is pinned to one core; on a
GPU (make gpu-check's async-stall item: --variants folder,folder-async --json) nothing is pinned,
so the background write has the host cores the step leaves idle.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir

from minddp.train.checkpoint import FILE, FOLDER
from minddp.train.config import register
from minddp.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("file", "folder", "folder-async", "dcp")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class PeakRSS:
    """The highest VmRSS while the block runs, sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb())


def dcp_state(trainer) -> dict:
    """What each rank owns: the model (replicated: DCP writes each tensor once) and this rank's
    ZeRO-1 shard of the optimizer state, under keys of its own."""
    rank = dist.get_rank()
    opt = {f"optim.rank{rank}.{i}.{k}": v for i, st in trainer.opt.optim.state_dict()["state"].items()
           for k, v in st.items() if isinstance(v, torch.Tensor)}
    return {**{f"model.{k}": v for k, v in trainer.model.state_dict().items()}, **opt}


def save(variant: str, trainer, step: int, folder: Path, group):
    """One checkpoint; returns minddp's save in progress for folder-async (committed after the
    next step)."""
    if variant != "dcp":  # what the trainer's CheckpointManager.save writes, without its retention
        manager = trainer.checkpoints
        everything = {**manager.state.state_dict(step, variant != "file"), **manager.identity}
        if variant == "folder-async":
            return FOLDER.save_in_background(folder, step, everything)
        (FILE if variant == "file" else FOLDER).save(folder, step, everything)
        return None  # committed already
    trainer.opt.wait_params()
    dcp.save(dcp_state(trainer), checkpoint_id=str(folder / f"dcp_{step:08d}"), process_group=group)
    return None


def timed_step(trainer, step: int) -> float:
    t0 = time.perf_counter()
    trainer.train_step(step)
    return time.perf_counter() - t0


def bench(args) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "data=synthetic", "data.num_samples=4096", "model.block_size=64", f"model.n_layer={args.n_layer}",
            f"model.n_embd={args.n_embd}", "model.n_head=8", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.eval_every=0", "train.ckpt_every=0", "train.max_steps=100000",
            "wandb.mode=disabled", f"ddp.shard_optimizer={str(args.zero1).lower()}", "optim.warmup_steps=1",
            "train.timeout_s=120"])
    run_dir = Path(args.dir) / "run"
    trainer = Trainer(cfg, str(run_dir))
    trainer.setup()
    group = dist.new_group(backend="gloo")  # DCP's collectives (torch's advice for async_save)
    variants = args.variants
    step, out = 0, {v: {"ckpt": [], "after": [], "normal": [], "peak": [], "save": []} for v in variants}
    for _ in range(2):  # warm-up: buckets, allocator, the optimizer's state
        step += 1
        timed_step(trainer, step)
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            normal = []
            for _ in range(args.normal):
                step += 1
                normal.append(timed_step(trainer, step))
            step += 1
            dist.barrier()
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                trainer.train_step(step)
                dist.barrier()  # the save alone: from every rank's start to its own end
                t_save = time.perf_counter()
                pending = save(v, trainer, step, run_dir, group)
                ckpt = time.perf_counter() - t0
                saved = time.perf_counter() - t_save
                step += 1
                t1 = time.perf_counter()
                trainer.train_step(step)  # overlaps folder-async's write
                if pending is not None:
                    pending.commit()
                after = time.perf_counter() - t1
            dist.barrier()
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            for p in run_dir.glob("dcp_*"):
                shutil.rmtree(p, ignore_errors=True)
            peaks = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, mem.peak - mem.base)
            o = out[v]
            o["ckpt"].append(ckpt)
            o["save"].append(max(all_ranks(saved)))  # the stall: the slowest rank's
            o["after"].append(after)
            o["normal"].append(statistics.median(normal))
            o["peak"].append(peaks)
    out["params"] = trainer.num_params
    out["device"] = f"{trainer.info.backend} on {trainer.info.device.type}"
    return out


def all_ranks(value: float) -> list[float]:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return got


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(out: dict, args) -> str:
    lines = [f"# What a checkpoint costs the step ({out['params'] / 1e6:.1f}M-parameter GPT, dp "
             f"{dist.get_world_size()}, ZeRO-1 {'on' if args.zero1 else 'off'}, {out['device']})", "",
             "Written by `make bench-checkpoint` (scripts/bench_checkpoint.py). Each round every variant "
             f"saves once, in rotated order; {args.rounds} rounds, medians (min-max). Ratios are over the "
             "median normal step of the same round, so all are from one run. What they decide: "
             "[checkpoints_at_scale.md](checkpoints_at_scale.md).", "",
             "| variant | normal step (s) | checkpoint step (s) | checkpoint / normal | next step / normal | "
             "rank 0 peak RSS over its level (MiB) | rank 1 (MiB) |", "|---|---|---|---|---|---|---|"]
    for v in args.variants:
        o = out[v]
        ratio = [c / n for c, n in zip(o["ckpt"], o["normal"])]
        after = [a / n for a, n in zip(o["after"], o["normal"])]
        ranks = [spread([p[r] for p in o["peak"]]) for r in (0, -1)]
        lines.append(f"| {v} | {spread(o['normal'])} | {spread(o['ckpt'])} | {spread(ratio)} | "
                     f"{spread(after)} | {ranks[0]} | {ranks[1]} |")
    if "dcp" in args.variants:
        bare = out["dcp"]["save"]
        lines += ["", "The save alone (from a barrier to the slowest rank's return; a folder's includes its "
                  "commit, the background one only its staging) over a bare `dcp.save` of the same tensors "
                  "in the same round (the target for `folder`: at most 1.25):", ""]
        for v in args.variants:
            if v != "dcp":
                ratio = [s / b for s, b in zip(out[v]["save"], bare)]
                lines.append(f"- {v}: {spread(out[v]['save'])} s, {spread(ratio)} x bare dcp.save "
                             f"({spread(bare)} s)")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--normal", type=int, default=2, help="normal steps before each save")
    parser.add_argument("--n-layer", type=int, default=16)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--zero1", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default=None, help="a markdown file for the table (rank 0)")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                        help=f"comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument("--json", default=None, help="the measurements as JSON (rank 0)")
    args = parser.parse_args()
    if set(args.variants) - set(VARIANTS) or not args.variants:
        parser.error(f"--variants: choose from {','.join(VARIANTS)}")
    rank = int(os.environ.get("RANK", "0"))
    if not torch.cuda.is_available():  # one core per rank; a GPU run leaves the host cores free
        os.sched_setaffinity(0, {rank % os.cpu_count()})
        torch.set_num_threads(1)
    register()
    scratch = args.dir is None  # one folder for every rank of this job (torchrun's run id)
    job = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    args.dir = args.dir or f"{tempfile.gettempdir()}/bench-ckpt-{job}"
    out = bench(args)
    if rank == 0:
        text = table(out, args)
        print(text)
        if args.out:
            Path(args.out).write_text(text)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    dist.barrier()
    if scratch and rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
