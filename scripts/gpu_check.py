"""make gpu-check: prove the GPU paths on a CUDA machine, in one command (< 10 min on one GPU).

    python3 scripts/gpu_check.py [--out gpu_check]     # any Python whose torch is a CUDA build
    make gpu-check PYTHON=python3                      # the same

Offline node: what this Python lacks of minddp's dependencies (hydra-core, omegaconf, tqdm, ...) is
installed from ./wheelhouse (`make wheelhouse` on a connected machine, then copy the folder) with
no index, into .venv-gpu, a venv that sees this Python's own torch (never reinstalled); then this
script runs again under it. With everything importable, nothing is installed.

One line per item, PASS / FAIL / SKIP with the reason, as each finishes; logs and summary.json
under --out. Exit 0 only if nothing failed; exit 1 with one line ("nothing was checked") when no
CUDA device is usable, naming a CPU-only torch build if that is why. What each item proves on 1
GPU and on 8: docs/gpu.md. The verdicts are pure functions of measured numbers (below), tested
on CPU with numbers that must pass and numbers that must fail (tests/dist/test_gpu_paths.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = {"hydra": "hydra-core", "omegaconf": "omegaconf", "yaml": "PyYAML", "tqdm": "tqdm", "numpy": "numpy"}
AGAIN = "MINDDP_GPU_CHECK_BOOTSTRAPPED"  # set when this script runs again under .venv-gpu
BUDGET_S = 570  # the whole run, on one GPU: under 10 minutes
MFU_FLOOR = 0.10  # GPT-2-small shape, bf16: fp32 matmuls (or a host sync per kernel) stay below it
OVERLAP_FLOOR = 0.30  # share of collective-kernel time with a backward kernel running beside it
BUSBW_FLOOR_GBS = 5.0  # all-reduce bus bandwidth at the largest size: below PCIe gen3 is broken
DEMOS_ONE_RANK_SKIPS = {"hierarchical": "needs 2 ranks per node and 2 nodes",
                        "ring_exchange": "needs 2 ranks", "deadlock": "needs 2 ranks",
                        "moe_dispatch": "needs 2 ranks"}
SMALL = ["model.n_layer=6", "model.n_embd=384", "model.n_head=6", "model.block_size=256",
         "train.micro_batch_size=16", "train.eval_every=0", "wandb.mode=disabled"]
GPT2 = ["model.n_layer=12", "model.n_embd=768", "model.n_head=12", "model.block_size=1024",
        "train.micro_batch_size=8", "train.eval_every=0", "wandb.mode=disabled"]  # for the MFU
RESULTS: dict[str, dict] = {}


# ------------------------------------------------------------- verdicts (pure, tested on CPU)
def union_length(intervals) -> float:
    from minddp.engine.observer import _union_length  # the union CommStats.busy_s uses (imported late:
    # this script must say "no torch" in one line before anything imports it)
    return _union_length(intervals)


def concurrent_fraction(comm, compute) -> float:
    """Share of the collective kernels' busy time during which some compute kernel also ran."""
    busy = union_length(comm)
    if busy <= 0:
        return 0.0
    both = busy + union_length(compute) - union_length([*comm, *compute])  # |A and B| = |A|+|B|-|A or B|
    return both / busy


def overlap_verdict(world: int, overlapped: float, serial: float, n_comm: int, floor: float = OVERLAP_FLOOR):
    """overlap=True must run collectives beside backward kernels; the overlap=False control must
    not (else the measurement itself is broken)."""
    if world < 2:
        return None, "world 1: no collective kernel to overlap; needs 2 GPUs"
    if n_comm == 0:
        return False, "no collective kernel in the profile"
    ok = overlapped >= floor and serial < floor
    return ok, (f"{100 * overlapped:.0f}% of collective-kernel time beside backward kernels (floor "
                f"{100 * floor:.0f}%); overlap=False control {100 * serial:.0f}% (must be below the floor)")


def comm_stats_verdict(world: int, busy_s: float, kernel_s: float, buckets: int):
    """CommStats' CUDA-event busy time against the profiler's collective kernels: within
    [0.8, 1.5] x plus 0.2 ms per bucket (launch latency)."""
    if world < 2:
        return None, "world 1: the all-reduce is a no-op, no collective kernel to time; needs 2 GPUs"
    if kernel_s <= 0:
        return False, "no collective kernel time in the profile"
    ok = 0.8 * kernel_s <= busy_s <= 1.5 * kernel_s + 2e-4 * buckets
    return ok, (f"busy_s {busy_s * 1e3:.2f} ms (CUDA events) vs collective kernels {kernel_s * 1e3:.2f} ms "
                f"(profiler), {buckets} buckets; allowed [0.8x, 1.5x + 0.2 ms/bucket]")


def stats_sane_verdict(busy_s: float, comm_time_s: float, exposed_s: float):
    """Timings where the backend gives no CUDA event (gloo with CUDA tensors): finite, positive,
    the busy union inside the first-launch-to-last-done span."""
    values = (busy_s, comm_time_s, exposed_s)
    ok = all(v == v and 0 <= v < 1e3 for v in values) and 0 < busy_s <= comm_time_s + 1e-6
    return ok, (f"busy {busy_s * 1e3:.2f} ms, span {comm_time_s * 1e3:.2f} ms, "
                f"exposed wait {exposed_s * 1e3:.2f} ms")


def mfu_verdict(mfu, floor: float = MFU_FLOOR):
    if mfu is None:
        return False, "no MFU (this GPU's bf16 peak is unknown, or it read above 100%)"
    return floor <= mfu <= 1, f"MFU {100 * mfu:.1f}% (floor {100 * floor:.0f}%)"


def sigterm_verdict(rc, ckpt_steps: list[int], loaded_step, last_logged, signalled_at: int):
    """A SIGTERM after step `signalled_at` (as Slurm sends it to every task): exit 0, one checkpoint,
    at the step the run stopped (the last one logged), that loads."""
    problems = []
    if rc != 0:
        problems.append(f"exit code {rc}, not 0")
    if not ckpt_steps:
        problems.append("no checkpoint")
    elif loaded_step is None:
        problems.append(f"checkpoint at step {ckpt_steps[-1]} does not load")
    elif loaded_step != last_logged or loaded_step < signalled_at:
        problems.append(f"checkpoint at step {loaded_step}, last logged step {last_logged}, "
                        f"signalled after step {signalled_at}")
    detail = (f"exit {rc}, checkpoints at {ckpt_steps[-3:]}, loaded step {loaded_step}, last logged "
              f"{last_logged}")
    return not problems, "; ".join(problems) or detail


def async_stall_verdict(measured: dict | None):
    """train.ckpt_async=auto writes in the background on CUDA: there a background save must cost
    the run less than a save in the step. From scripts/bench_checkpoint.py's rounds (each a
    normal step, the checkpoint step and the next, per variant): the checkpoint step's stall and
    the extra time over both steps (checkpoint + next - 2 normal, in normal steps), medians."""
    if not measured or not all(measured.get(v, {}).get("normal") for v in ("folder", "folder-async")):
        return False, "no measurement"

    def med(o, f):
        values = sorted(f(c, a, n) for c, a, n in zip(o["ckpt"], o["after"], o["normal"]))
        return values[len(values) // 2]

    stall = {v: med(measured[v], lambda c, a, n: c / n) for v in ("folder", "folder-async")}
    extra = {v: med(measured[v], lambda c, a, n: (c + a) / n - 2) for v in ("folder", "folder-async")}
    ok = stall["folder-async"] < stall["folder"] and extra["folder-async"] <= extra["folder"]
    return ok, (f"checkpoint step x{stall['folder-async']:.2f} in the background vs x{stall['folder']:.2f} "
                f"in the step; extra over it and the next step {extra['folder-async']:.2f} vs "
                f"{extra['folder']:.2f} normal steps (background must stall less and cost no more)")


def bench_verdict(world: int, rows: list[dict], floor: float = BUSBW_FLOOR_GBS):
    if world < 2:
        return None, "one rank: bus bandwidth is 0 by definition; needs 2 GPUs"
    if not rows:
        return False, "no results"
    wrong = sum(int(r["wrong"]) for r in rows)
    ar = [r for r in rows if r["op"] == "all_reduce"]
    best = max((float(r["busbw"]) for r in ar), default=0.0)
    ok = wrong == 0 and best >= floor
    return ok, f"all_reduce busbw {best:.1f} GB/s at best (floor {floor:.0f}), {wrong} wrong results"


def cpu_torch_note(torch_version: str, cuda_version, smi: str | None, floor: str = "2.11") -> str | None:
    """One line when nvidia-smi sees a GPU but torch is a CPU build (make install), else None."""
    if cuda_version is not None or not smi or "GPU" not in smi:
        return None
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", smi)
    tag = f"cu{m.group(1)}{m.group(2)}" if m else "cuXYZ (the CUDA version nvidia-smi shows)"
    base = torch_version.split("+")[0]
    return (f"minddp: nvidia-smi sees a GPU but torch {torch_version} is a CPU build. For the CUDA build: "
            f"pip install --force-reinstall torch=={base} --index-url https://download.pytorch.org/whl/{tag} "
            f"(torch >= {floor} works), or run on the node's own CUDA torch: make gpu-check PYTHON=python3")


# ------------------------------------------------------------ offline dependencies
def missing() -> list[str]:
    return [dist for mod, dist in NEEDED.items() if importlib.util.find_spec(mod) is None]


def say(line: str) -> None:
    print(line, flush=True)


def bootstrap(args) -> None:
    """Make minddp's dependencies importable without an index, then run this script again under that
    Python. Returns when everything is importable already."""
    if importlib.util.find_spec("torch") is None:
        say(f"gpu-check: nothing was checked: {sys.executable} has no torch; run with the Python that "
            "has the node's CUDA torch (make gpu-check PYTHON=...)")
        raise SystemExit(1)
    need = missing()
    if not need:
        return
    wheels = Path(args.wheelhouse)
    if os.environ.get(AGAIN) or not wheels.is_dir() or not any(wheels.iterdir()):
        say(f"gpu-check: nothing was checked: {', '.join(need)} not importable and no wheelhouse at "
            f"{wheels}; on a connected machine: make wheelhouse, then copy wheelhouse/ here")
        raise SystemExit(1)
    venv = Path(args.venv)
    python = venv / "bin" / "python"
    say(f"gpu-check: installing {', '.join(need)} from {wheels} (no index) into {venv}")
    pip = [str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels)]
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        see_this_python(venv, python)
        subprocess.run([*pip, *need], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        say(f"gpu-check: nothing was checked: installing {', '.join(need)} into {venv} failed ({e}); "
            f"a wheelhouse for this Python {sys.version_info.major}.{sys.version_info.minor}: "
            "make wheelhouse WHEEL_PYTHONS=...")
        raise SystemExit(1) from None
    # minddp itself without its dependencies: the node's torch stays (scripts also find it by path)
    if subprocess.run([*pip, "--no-deps", "-e", str(ROOT)]).returncode != 0:
        say("gpu-check: minddp not installed into the venv (runs from its folder instead)")
    os.execve(str(python), [str(python), str(Path(__file__).resolve()), *sys.argv[1:]],
              {**os.environ, AGAIN: "1"})


def see_this_python(venv: Path, python: Path) -> None:
    """--system-site-packages sees the base interpreter only: when this Python is itself a venv or
    has a .pth'd torch, a .pth in the new venv adds this Python's site folders (after its own)."""
    out = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    dirs = [d for d in [*site.getsitepackages(), site.getusersitepackages()] if Path(d).is_dir()]
    Path(out, "minddp_node_site.pth").write_text(f"import site; list(map(site.addsitedir, {dirs!r}))\n")


# ------------------------------------------------------------------------- running
class Clock:
    """Every command's timeout is cut to what is left of BUDGET_S; progress on the console."""

    def __init__(self, budget: float = BUDGET_S):
        self.t0, self.budget = time.monotonic(), budget

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def timeout(self, wanted: float) -> float:
        return max(1.0, min(wanted, self.left()))


CLOCK = Clock()


def torchrun(nproc: int, *args: str) -> list[str]:
    # the module, not a torchrun script: a venv over the system's torch has no bin/torchrun
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def env_for(extra=None) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "4", "PYTHONPATH": path,
            **(extra or {})}


def run(name: str, cmd: list[str], out: Path, timeout: int, env=None) -> tuple[bool, str]:
    limit = CLOCK.timeout(timeout)
    say(f"  ... {name} (up to {limit:.0f} s, {CLOCK.left():.0f} s of the budget left)")
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit, env=env_for(env))
        ok, text = p.returncode == 0, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        ok, text = False, f"timed out after {limit:.0f}s\n{e.stdout or ''}{e.stderr or ''}"
    (out / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n{text}")
    return ok, f"{time.monotonic() - t0:.0f}s, log {name}.log"


def verdict(item: str, ok: bool | None, detail: str) -> bool:
    word = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
    RESULTS[item] = {"verdict": word, "detail": detail}
    say(f"{word:5s} {item}: {detail}")
    return ok is not False


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return [r for r in rows if "step" in r and "loss" in r]


# ------------------------------------------------------------------------- items
def check_worker(mode: str, nproc: int, out: Path) -> bool:
    here = str(Path(__file__).resolve().with_name("gpu_check_worker.py"))
    ok, t = run(f"worker_{mode}", torchrun(nproc, here, mode, str(out)), out, 240)
    where = f"{nproc} rank(s), {'one GPU each over nccl' if mode == 'nccl' else 'sharing cuda:0 over gloo'}"
    path = out / f"worker_{mode}.json"
    if not path.exists():
        return verdict(f"{mode} worker", False, f"{where}: no results ({t})")
    good = True
    for name, (passed, detail) in json.loads(path.read_text()).items():
        good &= verdict(f"{name} ({mode})", passed, f"{where}: {detail}")
    return good & verdict(f"{mode} worker", ok, f"exit {'0' if ok else 'non-zero'}, {t}")


def check_demos(gpus: int, out: Path) -> bool:
    from minddp.demos import DEMOS

    good = True
    for name in DEMOS:
        if gpus == 1 and name in DEMOS_ONE_RANK_SKIPS:
            good &= verdict(f"demo {name}", None, DEMOS_ONE_RANK_SKIPS[name] + " (one GPU here)")
            continue
        ok, t = run(f"demo_{name}", torchrun(gpus, "-m", "minddp.demos", name), out, 90)
        good &= verdict(f"demo {name}", ok, f"{gpus} rank(s) on nccl, {t}")
    return good


def check_trainer(gpus: int, out: Path) -> bool:
    """GPT-2-small-shaped bf16 steps with an MFU above the floor, then a resume from the checkpoint."""
    run_dir = out / "trainer_run"
    env = {"MINDDP_RUN_DIR": str(run_dir)}
    base = [*GPT2, f"train.global_batch_size={8 * gpus}", "train.ckpt_every=25", "train.log_every=10"]
    ok, t = run("trainer", torchrun(gpus, "train.py", *base, "train.max_steps=50"), out, 150, env)
    rows = metrics(run_dir)
    last = rows[-1] if rows else {}
    learned = ok and last.get("step") == 50 and last["loss"] < rows[0]["loss"]
    good = verdict("trainer 50 steps bf16", learned,
                   f"step {last.get('step')}, loss {rows[0]['loss']:.3f} -> {last['loss']:.3f}, "
                   f"{last.get('tokens_per_s', 0):.0f} tok/s; {t}" if rows else t)
    mfu = mfu_verdict(last.get("mfu")) if learned else (False, "the run did not finish")
    good &= verdict("trainer MFU", *mfu)
    ok, t = run("trainer_resume", torchrun(gpus, "train.py", *base, "train.max_steps=60",
                                          "train.resume=auto"), out, 120, env)
    steps = [r["step"] for r in metrics(run_dir)]
    resumed = ok and bool(steps) and steps[-1] == 60 and 50 in steps and steps.count(10) == 1
    return good & verdict("resume from a GPU checkpoint", resumed,
                          f"steps logged {steps[:3]}...{steps[-3:]}; {t}")


def check_folder_checkpoints(gpus: int, out: Path, model: list[str] = SMALL) -> bool:
    """train.ckpt_format=dcp with ZeRO-1, saved in the background from CUDA tensors (a host copy,
    then DCP on a gloo group beside nccl): step 5's folder, written beside step 6, resumes."""
    run_dir = out / "dcp_run"
    env = {"MINDDP_RUN_DIR": str(run_dir)}
    base = [*model, f"train.global_batch_size={16 * gpus}", "train.ckpt_every=5", "train.log_every=1",
            "train.ckpt_format=dcp", "train.ckpt_async=true", "ddp.shard_optimizer=true"]
    ok, t = run("dcp_save", torchrun(gpus, "train.py", *base, "train.max_steps=10"), out, 120, env)
    folders = sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt_*")) if ok else []
    saved = folders == ["ckpt_00000005", "ckpt_00000010"]
    if saved:
        shutil.rmtree(run_dir / "checkpoints" / "ckpt_00000010")  # resume from the background one
    ok, t2 = run("dcp_resume", torchrun(gpus, "train.py", *base, "train.max_steps=8", "train.resume=auto"),
                 out, 120, env) if saved else (False, "not run")
    steps = [r["step"] for r in metrics(run_dir)]
    resumed = ok and steps[-3:] == [6, 7, 8]
    return verdict("folder checkpoints (dcp, background, ZeRO-1)", saved and resumed,
                   f"folders {folders}; steps after the resume {steps[-3:]}; {t}; {t2}")


ASYNC_STALL = "checkpoint stall: background (ckpt_async=auto on CUDA) vs in the step"


def check_async_stall(gpus: int, out: Path, model: tuple[int, int] = (12, 768), rounds: int = 3) -> bool:
    """What a background save stalls the step on this GPU, against one written in the step:
    scripts/bench_checkpoint.py's folder and folder-async, ZeRO-1, a GPT-2-small shape."""
    measured = out / "ckpt_bench.json"
    cmd = torchrun(gpus, str(ROOT / "scripts" / "bench_checkpoint.py"), "--variants", "folder,folder-async",
                   "--rounds", str(rounds), "--n-layer", str(model[0]), "--n-embd", str(model[1]),
                   "--json", str(measured), "--dir", str(out / "ckpt_bench"),
                   "--out", str(out / "ckpt_bench.md"))
    ok, t = run("async_stall", cmd, out, 240)
    numbers = json.loads(measured.read_text()) if ok and measured.exists() else None
    passed, detail = async_stall_verdict(numbers)
    return verdict(ASYNC_STALL, passed, f"{detail}; {t}")


def check_sigterm(gpus: int, out: Path, model: list[str] = SMALL) -> bool:
    """SIGTERM to every worker after step 5 (as Slurm sends it to each task): the step finishes, a
    checkpoint at that step is written and loads, the run exits 0."""
    run_dir = out / "sigterm_run"
    cmd = torchrun(gpus, "train.py", *model, f"train.global_batch_size={16 * gpus}", "train.max_steps=100000",
                   "train.ckpt_every=100000", "train.log_every=1")
    say(f"  ... SIGTERM run ({CLOCK.left():.0f} s of the budget left)")
    with (out / "sigterm.log").open("w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env=env_for({"MINDDP_RUN_DIR": str(run_dir)}))
        deadline = time.monotonic() + CLOCK.timeout(150)
        while len(metrics(run_dir)) < 5 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        signalled = len(metrics(run_dir))
        for pid in children(p.pid):
            os.kill(pid, signal.SIGTERM)
        try:
            rc = p.wait(timeout=CLOCK.timeout(90))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "killed after waiting"
    from minddp.train import checkpoint

    ckpts = checkpoint.all_checkpoints(run_dir)[::-1]  # oldest first; files or folders
    steps = [int(re.search(r"(\d+)", f.name).group(1)) for f in ckpts]
    loaded = None
    if ckpts:
        try:
            loaded = checkpoint.load(ckpts[-1], "cpu")["step"]
        except Exception as e:  # noqa: BLE001 - a FAIL naming it
            say(f"  checkpoint {ckpts[-1].name}: {type(e).__name__}: {e}")
    logged = metrics(run_dir)
    return verdict("SIGTERM: exit 0, a loadable checkpoint at the step it stopped",
                   *sigterm_verdict(rc, steps, loaded, logged[-1]["step"] if logged else None, signalled))


def children(pid: int) -> list[int]:
    """torchrun's workers (its child processes)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def check_tp(gpus: int, out: Path) -> bool:
    if gpus < 2:
        return verdict("tensor parallel tp=2", None, "needs 2 GPUs")
    run_dir = out / "tp_run"
    ok, t = run("trainer_tp2", torchrun(gpus, "train.py", *SMALL, f"train.global_batch_size={16 * gpus}",
                                        "train.max_steps=30", "mesh.tp=2"), out, 120,
                {"MINDDP_RUN_DIR": str(run_dir)})
    rows = metrics(run_dir)
    good = ok and bool(rows) and rows[-1]["step"] == 30 and rows[-1]["loss"] < rows[0]["loss"]
    return verdict("tensor parallel tp=2", good, f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; {t}"
                   if rows else t)


def check_bench(gpus: int, out: Path) -> bool:
    if gpus < 2:
        return verdict("collective benchmark (nccl)", *bench_verdict(gpus, []))
    csv = out / "bench.csv"
    cmd = torchrun(gpus, "-m", "minddp", "bench", "--backend", "nccl",
                   "--op", "all_reduce,all_gather,reduce_scatter", "-b", "8", "-e", "256MiB", "-f", "4",
                   "--csv", str(csv))
    ok, t = run("bench", cmd, out, 120)
    lines = csv.read_text().splitlines() if csv.exists() else []
    rows = [dict(zip(lines[0].split(","), line.split(","))) for line in lines[1:]]
    passed, detail = bench_verdict(gpus, rows if ok else [])
    return verdict("collective benchmark (nccl)", passed, f"{gpus} ranks: {detail}; {t}")


def why_no_cuda(torch, smi: str | None) -> str | None:
    """None when a CUDA device is usable, else the one-line reason (smi: nvidia-smi's output, None
    without one): no GPU here at all, or a CPU build of torch on a GPU machine."""
    if torch.version.cuda is None and not (smi and "GPU" in smi):
        return (f"nothing was checked: there is no GPU on this machine (no nvidia-smi sees one; torch "
                f"{torch.__version__} is a CPU-only build, as it should be here). On a GPU node: "
                "make wheelhouse here, copy wheelhouse/ over, run make gpu-check PYTHON=python3 there")
    if torch.version.cuda is None:
        return (f"nothing was checked: this torch is a CPU-only build (torch {torch.__version__}) on a GPU "
                "machine; install a CUDA wheel of the same version, or make gpu-check PYTHON=python3")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (f"nothing was checked: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
                f"CUDA device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    return None


def nvidia_smi() -> str | None:
    """nvidia-smi's output, or None where there is none (no driver, no GPU)."""
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def torch_build_line() -> None:
    """make install: one line when this torch is a CPU build on a machine whose nvidia-smi sees a GPU."""
    import torch

    from minddp._compat import TORCH_FLOOR

    note = cpu_torch_note(torch.__version__, torch.version.cuda, nvidia_smi(), TORCH_FLOOR)
    if note:
        say(note)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check"))
    ap.add_argument("--wheelhouse", default=str(ROOT / "wheelhouse"))
    ap.add_argument("--venv", default=str(ROOT / ".venv-gpu"))
    ap.add_argument("--torch-build", action="store_true",
                    help="only say whether torch is a CPU build on a GPU machine")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # minddp from its folder, installed or not
    if args.torch_build:
        return torch_build_line()
    bootstrap(args)
    import torch

    reason = why_no_cuda(torch, nvidia_smi() if torch.version.cuda is None else None)
    if reason:
        say(f"gpu-check: {reason}")
        raise SystemExit(1)
    from minddp import _compat

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpus, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    say(f"gpu-check on {gpus} x {name} (torch {torch.__version__}, CUDA {torch.version.cuda}; minddp needs "
        f"torch >= {_compat.TORCH_FLOOR}), logs in {out}/, budget {BUDGET_S} s")
    items = [lambda: check_worker("nccl", gpus, out), lambda: check_worker("gloo-cuda", 2, out),
             lambda: check_trainer(gpus, out), lambda: check_folder_checkpoints(gpus, out),
             lambda: check_async_stall(gpus, out),
             lambda: check_sigterm(gpus, out), lambda: check_tp(gpus, out),
             lambda: check_bench(gpus, out), lambda: check_demos(gpus, out)]
    good = True
    for i, item in enumerate(items, 1):  # every item runs; one past the budget is a FAIL saying so
        say(f"[{i}/{len(items)}]")
        good &= item() if CLOCK.left() > 5 else verdict(f"item {i}", False, "not run: the budget was spent")
    summary = {"device": name, "gpus": gpus, "torch": torch.__version__, "cuda": torch.version.cuda,
               "seconds": round(time.monotonic() - CLOCK.t0), "passed": good, "items": RESULTS}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    say(f"{'all passed' if good else 'FAILED'} in {summary['seconds']} s; summary {out / 'summary.json'}")
    raise SystemExit(0 if good else 1)


if __name__ == "__main__":
    main()
