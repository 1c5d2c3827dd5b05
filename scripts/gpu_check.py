"""make gpu-check: prove the GPU paths on the first CUDA machine, in one command (< 5 min).

    python scripts/gpu_check.py [--out gpu_check]        # = make gpu-check

Works on one GPU (the likeliest first machine) and on several. Prints one verdict line per
item (PASS / FAIL / SKIP with the reason) and writes every log under --out:
1. the textbook demos on the GPU (nccl, one rank per GPU);
2. minddp vs torch DDP on CUDA tensors: nccl with one rank per GPU (world 1 on one GPU),
   and 2 ranks sharing GPU 0 through gloo (nccl refuses two ranks on one GPU);
3. the trainer, 50 steps in bf16, with its MFU;
4. the collective benchmark table on nccl (nccl-tests columns).
On a machine without CUDA every item says "no CUDA device" and the script exits 0.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEMOS_ONE_RANK_SKIPS = {"hierarchical": "needs 2 ranks per node and 2 nodes",
                        "ring_exchange": "needs 2 ranks", "deadlock": "needs 2 ranks",
                        "moe_dispatch": "needs 2 ranks"}


def torchrun(nproc: int, *args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *args]


def run(name: str, cmd: list[str], out: Path, timeout: int, env=None) -> tuple[bool, str]:
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "WANDB_MODE": "disabled", **(env or {})})
        ok, text = p.returncode == 0, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        ok, text = False, f"timed out after {timeout}s\n{e.stdout or ''}{e.stderr or ''}"
    (out / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n{text}")
    return ok, f"{time.monotonic() - t0:.0f}s"


def verdict(item: str, ok: bool | None, detail: str) -> bool:
    word = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
    print(f"{word:5s} {item}: {detail}", flush=True)
    return ok is not False


def check_demos(gpus: int, out: Path) -> bool:
    from minddp.demos import DEMOS

    good = True
    for name in DEMOS:
        if gpus == 1 and name in DEMOS_ONE_RANK_SKIPS:
            good &= verdict(f"demo {name}", None, DEMOS_ONE_RANK_SKIPS[name] + " (one GPU here)")
            continue
        ok, t = run(f"demo_{name}", torchrun(gpus, "-m", "minddp.demos", name), out, 120)
        good &= verdict(f"demo {name}", ok, f"{gpus} rank(s) on nccl, {t}; log demo_{name}.log")
    return good


def check_equivalence(gpus: int, out: Path) -> bool:
    here = str(Path(__file__).resolve())
    ok1, t1 = run("equivalence_nccl", torchrun(gpus, here, "--worker", "nccl"), out, 180)
    good = verdict("minddp == torch DDP, nccl", ok1, f"{gpus} rank(s), {t1}; log equivalence_nccl.log")
    ok2, t2 = run("equivalence_gloo_cuda", torchrun(2, here, "--worker", "gloo-cuda"), out, 180)
    return good & verdict("minddp == torch DDP, gloo on CUDA tensors", ok2,
                          f"2 ranks sharing cuda:0, {t2}; log equivalence_gloo_cuda.log")


def check_trainer(gpus: int, out: Path) -> bool:
    run_dir = out / "trainer_run"
    cmd = torchrun(gpus, "train.py", "train.max_steps=50", "train.bf16=true", "train.eval_every=25",
                   "train.log_every=10", "model.n_layer=6", "model.n_embd=384", "model.n_head=6",
                   "model.block_size=256", "train.global_batch_size=64",
                   f"train.micro_batch_size={64 // gpus}")
    ok, t = run("trainer", cmd, out, 240, env={"MINDDP_RUN_DIR": str(run_dir)})
    detail = f"{t}; log trainer.log"
    metrics = run_dir / "metrics.jsonl"
    rows = metrics.read_text().splitlines() if metrics.exists() else []
    if rows:
        import json

        last = json.loads(rows[-1])
        detail = (f"step {last['step']}, loss {last['loss']:.3f}, {last['tokens_per_s']:.0f} tok/s, "
                  f"{last['tflops']:.1f} TFLOP/s, MFU {100 * last['mfu']:.1f}%, " + detail)
        ok = ok and last["step"] == 50 and last["loss"] < json.loads(rows[0])["loss"]
    return verdict("trainer 50 steps bf16", ok, detail)


def check_bench(gpus: int, out: Path) -> bool:
    cmd = torchrun(gpus, "-m", "minddp", "bench", "--backend", "nccl",
                   "--op", "all_reduce,all_gather,reduce_scatter", "-b", "8", "-e", "256MiB", "-f", "4",
                   "--csv", str(out / "bench.csv"))
    ok, t = run("bench", cmd, out, 180)
    return verdict("collective benchmark (nccl)", ok, f"{gpus} rank(s), {t}; table in bench.log")


def worker(mode: str) -> None:
    """Under torchrun: minddp's gradients equal torch DDP's on CUDA tensors (fp32, bf16-compressed)."""
    from torch import nn

    import minddp
    from minddp.dist import init_distributed, shutdown

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if mode == "nccl":
        info = init_distributed("cuda")
        assert info.backend == "nccl" and info.device == torch.device("cuda", local), info
        device = info.device
    else:  # two ranks on one GPU: gloo moves CUDA tensors through host memory
        torch.distributed.init_process_group("gloo")
        device = torch.device("cuda", 0)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(device)
    x = torch.randn(8, 64, device=device) + torch.distributed.get_rank()
    errors = {}
    for name, kwargs in {"fp32": {}, "bf16": {"compress": "bf16"}}.items():
        ours = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=0.01, **kwargs)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        for m in (ours, theirs):
            for _ in range(2):  # the second iteration runs on rebuilt buckets
                m.zero_grad()
                m(x).square().mean().backward()
        errors[name] = max((a.grad - b.grad).abs().max().item()
                           for a, b in zip(ours.module.parameters(), theirs.module.parameters()))
        stats = ours.comm_stats  # CUDA events on nccl: the time of the work, not of the launch
        assert stats.num_collectives == len(ours.bucket_assignment) and stats.busy_s >= 0, stats
    assert errors["fp32"] < 1e-5 and errors["bf16"] < 5e-2, errors
    print(f"rank {torch.distributed.get_rank()}: max |grad - torch DDP| {errors}, "
          f"busy {stats.busy_s * 1e3:.3f} ms")
    shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check"))
    ap.add_argument("--worker", choices=["nccl", "gloo-cuda"])
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    items = ["demos", "minddp == torch DDP", "trainer 50 steps bf16", "collective benchmark"]
    if not torch.cuda.is_available():
        for item in items:
            verdict(item, None, "no CUDA device")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    print(f"gpu-check on {gpus} x {torch.cuda.get_device_name(0)}, logs in {out}/", flush=True)
    good = all([check_demos(gpus, out), check_equivalence(gpus, out), check_trainer(gpus, out),
                check_bench(gpus, out)])
    raise SystemExit(0 if good else 1)


if __name__ == "__main__":
    main()
