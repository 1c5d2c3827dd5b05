"""make gpu-check: prove the GPU paths on a CUDA machine, in one command (< 10 min).

    python scripts/gpu_check.py [--out gpu_check]        # = make gpu-check

One verdict line per item (PASS / FAIL / SKIP with the reason), every log and a JSON summary
(summary.json) under --out. Exit 0 only if nothing failed; exit 1 with one line ("nothing was
checked") when no CUDA device is usable, naming a CPU-only torch build if that is why.

On any number of GPUs:
- the textbook demos on nccl, one rank per GPU;
- scripts/gpu_check_worker.py on nccl (one rank per GPU; world 1 on one GPU): minddp's gradients
  against torch DDP's for DDP, ZeRO-1, optimizer_overlap, fp16 and bf16 compression; no host sync
  in a steady step (torch.cuda.set_sync_debug_mode("error")) for DDP, ZeRO-1, optimizer_overlap;
  a profiled step whose CUDA-event comm stats agree with the collective kernels (and, with 2+
  GPUs, collective kernels running while backward kernels run); allocated and reserved memory
  flat over 200 steps; NCCL's flight recorder non-empty; with 2+ GPUs also
  find_unused_parameters against torch DDP and join() with uneven inputs;
- the same worker with 2 ranks on cuda:0 over gloo: the engine's stream handling with CUDA
  tensors even on one GPU (the equivalence checks);
- the trainer: bf16 steps with an MFU in (0, 100%], resume from its GPU checkpoint, a SIGTERM
  that saves; tensor parallelism tp=2 with 2+ GPUs;
- the collective benchmark on nccl (nccl-tests columns).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
TRAIN = ["model.n_layer=6", "model.n_embd=384", "model.n_head=6", "model.block_size=256",
         "train.micro_batch_size=16", "train.eval_every=0", "train.log_every=10", "wandb.mode=disabled"]
RESULTS: dict[str, dict] = {}


def torchrun(nproc: int, *args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *args]


def run(name: str, cmd: list[str], out: Path, timeout: int, env=None) -> tuple[bool, str]:
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "4",
                                **(env or {})})
        ok, text = p.returncode == 0, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        ok, text = False, f"timed out after {timeout}s\n{e.stdout or ''}{e.stderr or ''}"
    (out / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n{text}")
    return ok, f"{time.monotonic() - t0:.0f}s, log {name}.log"


def verdict(item: str, ok: bool | None, detail: str) -> bool:
    word = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
    RESULTS[item] = {"verdict": word, "detail": detail}
    print(f"{word:5s} {item}: {detail}", flush=True)
    return ok is not False


def why_no_cuda() -> str | None:
    """None when a CUDA device is usable, else the one-line reason."""
    if torch.version.cuda is None:
        return (f"nothing was checked: this torch is a CPU-only build (torch {torch.__version__}); "
                "install a CUDA wheel of the same version on the GPU machine")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (f"nothing was checked: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
                f"CUDA device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    return None


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


# ------------------------------------------------------------------------- items
def check_demos(gpus: int, out: Path) -> bool:
    from minddp.demos import DEMOS

    good = True
    for name in DEMOS:
        if gpus == 1 and name in DEMOS_ONE_RANK_SKIPS:
            good &= verdict(f"demo {name}", None, DEMOS_ONE_RANK_SKIPS[name] + " (one GPU here)")
            continue
        ok, t = run(f"demo_{name}", torchrun(gpus, "-m", "minddp.demos", name), out, 120)
        good &= verdict(f"demo {name}", ok, f"{gpus} rank(s) on nccl, {t}")
    return good


def check_worker(mode: str, nproc: int, out: Path) -> bool:
    here = str(Path(__file__).resolve().with_name("gpu_check_worker.py"))
    ok, t = run(f"worker_{mode}", torchrun(nproc, here, mode, str(out)), out, 300)
    where = f"{nproc} rank(s), {'one GPU each' if mode == 'nccl' else 'sharing cuda:0 over gloo'}"
    path = out / f"worker_{mode}.json"
    if not path.exists():
        return verdict(f"{mode} worker", False, f"{where}: no results ({t})")
    good = True
    for name, (passed, detail) in json.loads(path.read_text()).items():
        good &= verdict(f"{name} ({mode})", passed, f"{where}: {detail}")
    return good & verdict(f"{mode} worker", ok, t)


def check_trainer(gpus: int, out: Path) -> bool:
    """bf16 steps with an MFU in (0, 100%], then a resume of the same run from its checkpoint."""
    run_dir = out / "trainer_run"
    env = {"MINDDP_RUN_DIR": str(run_dir)}
    base = [*TRAIN, f"train.global_batch_size={16 * gpus}", "train.ckpt_every=25"]
    ok, t = run("trainer", torchrun(gpus, "train.py", *base, "train.max_steps=50"), out, 240, env)
    rows = metrics(run_dir)
    last = rows[-1] if rows else {}
    mfu = last.get("mfu")
    good = (ok and last.get("step") == 50 and last["loss"] < rows[0]["loss"]
            and mfu is not None and 0 < mfu <= 1)
    detail = (f"step {last.get('step')}, loss {rows[0]['loss']:.3f} -> {last['loss']:.3f}, "
              f"{last['tokens_per_s']:.0f} tok/s, MFU {'none' if mfu is None else f'{100 * mfu:.1f}%'}; {t}"
              if rows else t)
    good = verdict("trainer 50 steps bf16, MFU in (0, 100%]", good, detail)
    ok, t = run("trainer_resume", torchrun(gpus, "train.py", *base, "train.max_steps=60",
                                          "train.resume=auto"), out, 240, env)
    steps = [r["step"] for r in metrics(run_dir)]
    resumed = ok and bool(steps) and steps[-1] == 60 and 50 in steps and steps.count(10) == 1
    return good & verdict("resume from a GPU checkpoint", resumed,
                          f"steps logged {steps[:3]}...{steps[-3:]}; {t}")


def check_sigterm(gpus: int, out: Path) -> bool:
    """SIGTERM mid-run (as Slurm sends it; torchrun passes it on): the step finishes and a
    checkpoint is written."""
    run_dir = out / "sigterm_run"
    cmd = torchrun(gpus, "train.py", *TRAIN, f"train.global_batch_size={16 * gpus}", "train.max_steps=100000",
                   "train.ckpt_every=100000", "train.log_every=1")
    log = (out / "sigterm.log").open("w")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "WANDB_MODE": "disabled", "MINDDP_RUN_DIR": str(run_dir)})
    deadline = time.monotonic() + 180
    while len(metrics(run_dir)) < 5 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    p.send_signal(signal.SIGTERM)
    try:
        rc = p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = "killed after 120 s"
    folder = run_dir / "checkpoints"
    saved = sorted(f.name for f in folder.glob("*")) if folder.exists() else []
    return verdict("SIGTERM saves a checkpoint", bool(saved),  # torchrun's own exit code varies
                   f"torchrun exit {rc}, checkpoints {saved[-2:]}; log sigterm.log")


def check_tp(gpus: int, out: Path) -> bool:
    if gpus < 2:
        return verdict("tensor parallel tp=2", None, "needs 2 GPUs")
    run_dir = out / "tp_run"
    ok, t = run("trainer_tp2", torchrun(gpus, "train.py", *TRAIN, f"train.global_batch_size={16 * gpus}",
                                        "train.max_steps=30", "mesh.tp=2"), out, 240,
                {"MINDDP_RUN_DIR": str(run_dir)})
    rows = metrics(run_dir)
    good = ok and bool(rows) and rows[-1]["step"] == 30 and rows[-1]["loss"] < rows[0]["loss"]
    return verdict("tensor parallel tp=2", good, f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; {t}"
                   if rows else t)


def check_bench(gpus: int, out: Path) -> bool:
    cmd = torchrun(gpus, "-m", "minddp", "bench", "--backend", "nccl",
                   "--op", "all_reduce,all_gather,reduce_scatter", "-b", "8", "-e", "256MiB", "-f", "4",
                   "--csv", str(out / "bench.csv"))
    ok, t = run("bench", cmd, out, 180)
    return verdict("collective benchmark (nccl)", ok, f"{gpus} rank(s), {t}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check"))
    args = ap.parse_args()
    reason = why_no_cuda()
    if reason:
        print(f"gpu-check: {reason}", flush=True)
        raise SystemExit(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    print(f"gpu-check on {gpus} x {name} (torch {torch.__version__}, CUDA {torch.version.cuda}), "
          f"logs in {out}/", flush=True)
    t0 = time.monotonic()
    good = all([check_worker("nccl", gpus, out), check_worker("gloo-cuda", 2, out),  # every item runs
                check_demos(gpus, out), check_trainer(gpus, out), check_sigterm(gpus, out),
                check_tp(gpus, out), check_bench(gpus, out)])
    summary = {"device": name, "gpus": gpus, "torch": torch.__version__, "cuda": torch.version.cuda,
               "seconds": round(time.monotonic() - t0), "passed": good, "items": RESULTS}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{'all passed' if good else 'FAILED'} in {summary['seconds']} s; summary {out / 'summary.json'}")
    raise SystemExit(0 if good else 1)


if __name__ == "__main__":
    main()
