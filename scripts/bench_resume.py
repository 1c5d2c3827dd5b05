"""What a resume costs each rank: peak RSS and bytes read, against the training that wrote it.

    python scripts/bench_resume.py --out docs/bench_resume.md        (make bench-resume)

For each layout (dp 2 and dp 4, ZeRO-1 and plain; tp 2 x dp 2 with ZeRO-1) the trainer itself
runs twice under torchrun, as a user would: 2 steps with a folder checkpoint at step 2, then
`train.resume=auto` for one step more, each a fresh process. Each rank reports its peak RSS
(ru_maxrss) and, in the resumed run, the bytes of stored items DCP read into its tensors (the
trainer.checkpoints.bytes_read: checked by sharded.CheckedReader) and every byte it read while
setting up (/proc/self/io rchar: state.pt, .metadata, the items). The table sets them against
the checkpoint's size over the world plus what every rank holds whole (the model; with plain
DDP the optimizer state too; state.pt and .metadata): the targets are the busiest rank's
resumed peak within training's + 10% and bytes read within 1.2 x that share.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {  # name: (nproc, overrides)
    "dp2-zero1": (2, ["ddp.shard_optimizer=true"]),
    "dp2-plain": (2, ["ddp.shard_optimizer=false"]),
    "dp4-zero1": (4, ["ddp.shard_optimizer=true"]),
    "dp4-plain": (4, ["ddp.shard_optimizer=false"]),
    "tp2xdp2-zero1": (4, ["ddp.shard_optimizer=true", "mesh.tp=2"]),
}


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def worker(args) -> None:
    """One rank of one run (under torchrun): the trainer, then this rank's numbers as JSON."""
    from hydra import compose, initialize_config_dir

    from minddp.train.config import register
    from minddp.train.trainer import Trainer

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "data=synthetic", "data.num_samples=512", "model.block_size=64", f"model.n_layer={args.n_layer}",
            f"model.n_embd={args.n_embd}", "model.n_head=8", "train.global_batch_size=8",
            "train.micro_batch_size=2", "train.eval_every=0", "train.ckpt_every=2", "train.ckpt_format=dcp",
            "train.ckpt_async=false", "wandb.mode=disabled", "optim.warmup_steps=1", "train.timeout_s=300",
            f"train.max_steps={2 if args.phase == 'train' else 3}",
            f"train.resume={'none' if args.phase == 'train' else 'auto'}", *args.overrides])
    before = rchar()
    trainer = Trainer(cfg, args.run_dir)
    trainer.setup()
    read_in_setup = rchar() - before
    trainer.fit()
    rank = int(os.environ["RANK"])
    out = {"rank": rank, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "items_read": trainer.checkpoints.bytes_read, "read_in_setup": read_in_setup,
           "params": trainer.num_params}
    Path(args.report, f"{args.phase}-{rank}.json").write_text(json.dumps(out))


def run_layout(name: str, args, scratch: Path) -> dict:
    nproc, overrides = LAYOUTS[name]
    run_dir, report = scratch / name / "run", scratch / name / "report"
    report.mkdir(parents=True)
    for phase in ("train", "resume"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "--phase", phase, "--run-dir", str(run_dir), "--report", str(report),
               "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               **dict(kv.split("=", 1) for kv in args.env)}
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if p.returncode:
            raise SystemExit(f"{name} {phase}: exit {p.returncode}\n{p.stderr[-3000:]}")
    ranks = {phase: [json.loads(Path(report, f"{phase}-{r}.json").read_text()) for r in range(nproc)]
             for phase in ("train", "resume")}
    folder = next(p for p in sorted((run_dir / "checkpoints").iterdir()) if p.name == "ckpt_00000002")
    files = json.loads((folder / "integrity.json").read_text())
    size = sum(f.stat().st_size for f in folder.iterdir())
    small = sum((folder / n).stat().st_size for n in ("state.pt", "integrity.json")) + 2 * (
        folder / ".metadata").stat().st_size  # every rank: state.pt, .metadata (the choice's and DCP's)
    model = sum(n for name_, _, n, _ in _items(folder) if name_.startswith("model/"))
    replicated = model if "shard_optimizer=true" in " ".join(overrides) else sum(n for *_, n, _ in
                                                                                _items(folder))
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"nproc": nproc, "overrides": overrides, "ranks": ranks, "size": size, "model": model,
            "small": small, "replicated": replicated, "version": files.get("version")}


def _items(folder: Path):
    """(entry name, file, length, offset) of each stored item, from DCP's index."""
    from minddp.train.checkpoint.dcp_reader import SafeReader

    index = SafeReader(folder).read_metadata()
    return [(i.fqn, info.relative_path, info.length, info.offset) for i, info in index.storage_data.items()]


def table(results: dict, args) -> str:
    mib = 2 ** 20
    some = next(iter(results.values()))
    if args.append:  # a second pass under other settings, below the first
        lines = [f"## The same with {' '.join(args.env)}", "", *_header()]
    else:
        lines = ["# What a resume costs each rank (make bench-resume)", "", *_intro(some, args), "",
                 *_header()]
    verdicts = [_rows(name, r, lines, mib) for name, r in results.items()]
    return "\n".join(lines + ["", *verdicts, ""])


def _intro(some, args) -> list[str]:
    return [
        f"The trainer, a GPT of {some['ranks']['train'][0]['params'] / 1e6:.1f}M parameters "
        f"(n_layer {args.n_layer}, n_embd {args.n_embd}) with AdamW, on the CPU with gloo: 2 steps with a "
        "folder checkpoint at step 2, then `train.resume=auto` for one step more, each a fresh torchrun "
        "job. Peak RSS is each rank's ru_maxrss; *read* the bytes of the checkpoint the rank read: the "
        "stored items DCP read into its tensors (each checked against its CRC-32) plus state.pt, "
        "integrity.json and .metadata (twice: the choice's and DCP's); *rchar* every byte the process "
        "read while setting up (/proc/self/io: its imports and data too). *Share* is the checkpoint's "
        "size over the world plus what every rank reads whole (the model, the small files; with plain "
        "DDP the optimizer state too). Written by `scripts/bench_resume.py`."]


def _header() -> list[str]:
    return ["| layout | checkpoint | share per rank | rank | training peak RSS | resumed peak RSS "
            "| resumed / training | read | read / share | rchar in setup |",
            "|---|---|---|---|---|---|---|---|---|---|"]


def _rows(name: str, r: dict, lines: list, mib: int) -> str:
    world = r["nproc"]
    whole = r["replicated"] + r["small"]
    share = (r["size"] - whole) / world + whole
    worst_read = 0.0
    for t, z in zip(r["ranks"]["train"], r["ranks"]["resume"]):
        ratio = z["peak_rss_mb"] / t["peak_rss_mb"]
        read = z["items_read"] + r["small"]
        worst_read = max(worst_read, read / share)
        lines.append(f"| {name} | {r['size'] / mib:.1f} MiB | {share / mib:.1f} MiB | {t['rank']} | "
                     f"{t['peak_rss_mb']:.0f} MiB | {z['peak_rss_mb']:.0f} MiB | {ratio:.2f} | "
                     f"{read / mib:.1f} MiB | {read / share:.2f} | {z['read_in_setup'] / mib:.1f} MiB |")
    busiest = max(z["peak_rss_mb"] for z in r["ranks"]["resume"])
    trained = max(t["peak_rss_mb"] for t in r["ranks"]["train"])
    return (f"- {name}: busiest rank resumed at {busiest:.0f} MiB against {trained:.0f} MiB in training "
            f"({busiest / trained - 1:+.0%}; target at most +10%); the most any rank read is "
            f"{worst_read:.2f} x its share (target at most 1.2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="a markdown file for the table")
    parser.add_argument("--json", default=None, help="the measurements as JSON")
    parser.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                        help=f"comma-separated, of {','.join(LAYOUTS)}")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set for every run (e.g. MALLOC_MMAP_THRESHOLD_=131072)")
    parser.add_argument("--append", action="store_true", help="add the table below --out's, as a second pass")
    parser.add_argument("--phase", choices=("train", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        return worker(args)
    if set(args.layouts) - set(LAYOUTS):
        parser.error(f"--layouts: choose from {','.join(LAYOUTS)}")
    scratch = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    try:
        results = {name: run_layout(name, args, scratch) for name in args.layouts}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = table(results, args)
    print(text)
    if args.out:
        Path(args.out).write_text((Path(args.out).read_text() + "\n" if args.append else "") + text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
