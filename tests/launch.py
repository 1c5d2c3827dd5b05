"""The one way tests start processes. Three kinds, cheapest first:

- `ranks(fn, n, *args)`: fn(rank, n, *args) on n forked gloo processes (fork: nothing to
  re-import), every rank's result back, every rank's traceback on failure, a hang named;
- `script(argv, n)`, `train_py(overrides, n)`, `command(line)`, `run_train(run_dir, ...)`: a script,
  `python -m` module or documented command line on n ranks forked from a fork server that has
  imported torch, Hydra and train.py, each with torchrun's worker environment, run as `python`
  would (runpy: train.py from Hydra's parsing to its exit code); every rank's exit code in
  `returncodes`;
- `torchrun(...)`, `running_job(...)`, `train_until_sigterm(...)`: torchrun itself, where the agent
  is what is tested (restarts, passing on signals, its failure summary, TORCHELASTIC_*).
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GRACE_S = 10.0  # after a rank fails, how long the others get to report before they are killed


# ------------------------------------------------------------ a function on n gloo ranks
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, args, queue, env):
    try:
        os.environ.clear()  # the test's environment (a fork server started with an older one)
        os.environ.update(env)
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
        try:
            # plain pickle: torch's queue pickler would share tensors through
            # shared memory that vanishes when this process exits
            queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every rank reports its own failure
        queue.put((rank, "error", traceback.format_exc()))


def ranks(fn, world_size: int, *args, timeout: float = 60.0) -> list:
    """Run fn(rank, world_size, *args) on world_size processes; return the results by rank.

    Raises with every rank's traceback if any rank fails, and on timeout (a hang)
    names the ranks that never answered.
    """
    results = _run(fn, world_size, args, timeout)
    errors = {r: v for r, (status, v) in results.items() if status != "ok"}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r}:\n{v}" for r, v in sorted(errors.items())))
    return [pickle.loads(results[r][1]) for r in range(world_size)]


def ranks_expect_errors(fn, world_size: int, *args, timeout: float = 60.0) -> dict[int, str]:
    """Run fn and return {rank: error text}; fails if some rank did not raise."""
    results = _run(fn, world_size, args, timeout)
    ok = [r for r, (status, _) in results.items() if status == "ok"]
    assert not ok, f"ranks {ok} did not raise"
    return {r: v for r, (_, v) in results.items()}


def _comm_threads() -> list[str]:
    """This process's threads that belong to a process group (gloo, its TCPStore), by name."""
    names = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(comm) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return [n for n in names if n.startswith(("pt_gloo", "gloo_", "pt_tcpstore"))]


def _context(fn, args):
    """fork (fast: nothing to re-import) unless this process still runs a process group's
    threads (a test that trained in process): a child forked from a process with such threads
    can inherit a lock one of them held and hang. Then a fork server, itself started clean
    (for a function it can import: a test's local function still forks)."""
    if not _comm_threads():
        return mp.get_context("fork")
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError):
        return mp.get_context("fork")
    return forkserver()


# what every process forked for a test imports once, in the fork server: torch, dynamo (the
# first optimizer step imports it: 1.2 s), Hydra and train.py
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hydra", "train", "tests.launch"]


def forkserver():
    """multiprocessing's fork server (one per test session, itself started clean: no process
    group threads, no logging handlers or Hydra state from a test that trained in process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run(fn, world_size, args, timeout):
    ctx = _context(fn, args)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, queue, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise AssertionError(
                    f"timeout after {timeout}s: ranks {missing} never finished (a hang); "
                    f"answers so far: {results}")
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
                results[rank] = (status, value)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    # a rank died without reporting (segfault, os._exit): give the rest a moment
                    time.sleep(0.5)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return results


# ------------------------------------------- a script or command line on n forked ranks
def _rank_main(argv, env, cwd, out_path, err_path) -> None:
    """One rank: argv is [script, *args] or ["-m", module, *args], as after `python`."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    code = 1
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # Hydra finds conf/ beside the __main__ file; a finished run ends in os._exit
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python script` does
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # what the interpreter would make of it
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an uncaught exception: traceback, exit 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def script(argv, nproc=1, env=None, cwd=None, timeout=180.0) -> subprocess.CompletedProcess:
    """Run argv (what follows `python`) on nproc ranks; returncode is 0, else the lowest failed
    rank's code (a signal: minus its number); `returncodes` holds every rank's. Started again,
    once, if rank 0's store lost its free port to another process before it bound it."""
    p = _script(argv, nproc, env, cwd, timeout)
    if nproc > 1 and p.returncode and "EADDRINUSE" in p.stderr:
        p = _script(argv, nproc, env, cwd, timeout)
    return p


def _script(argv, nproc, env, cwd, timeout) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env)
    if nproc > 1:
        env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    ctx = forkserver()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        for f in (out, err):
            f.touch()  # every rank appends to these two, as torchrun's workers share its output
        procs = []
        for rank in range(nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if nproc > 1 else env
            procs.append(ctx.Process(target=_rank_main, args=(list(argv), rank_env, str(cwd or ROOT),
                                                               str(out), str(err))))
            procs[-1].start()
        codes = _wait(procs, timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if codes is None:
        raise subprocess.TimeoutExpired(list(argv), timeout, stdout, stderr)
    p = subprocess.CompletedProcess(list(argv), next((c for c in codes if c), 0), stdout, stderr)
    p.returncodes = codes
    return p


def train_py(overrides, nproc=1, env=None, cwd=None, timeout=180.0) -> subprocess.CompletedProcess:
    return script([str(ROOT / "train.py"), *overrides], nproc, env, cwd, timeout)


def command(line: str, env=None, cwd=None, timeout=180.0) -> subprocess.CompletedProcess:
    """A documented command line: `torchrun [--standalone] --nproc_per_node=N <script | -m mod> ...`,
    `python <script | -m mod> ...` or `minddp <tool> ...`."""
    words = shlex.split(line)
    if words[0] == "minddp":
        return script(["-m", "minddp", *words[1:]], 1, env, cwd, timeout)
    if words[0] == "python":
        return script(words[1:], 1, env, cwd, timeout)
    assert words[0] == "torchrun", line
    nproc, rest = 1, words[1:]
    while rest[0].startswith("--"):
        if rest[0].startswith(("--nproc_per_node=", "--nproc-per-node=")):
            nproc = int(rest[0].split("=", 1)[1])
        elif rest[0] != "--standalone":
            raise ValueError(f"{rest[0]}: only --standalone and --nproc_per_node are run forked")
        rest = rest[1:]
    return script(rest, nproc, env, cwd, timeout)


def _wait(procs, timeout) -> list[int] | None:
    """Every rank's exit code; None after a timeout. A rank that fails gives the others
    GRACE_S to finish (they report the same error), then they are killed, as torchrun does."""
    deadline = time.monotonic() + timeout
    while any(p.exitcode is None for p in procs):
        if any(p.exitcode for p in procs):
            deadline = min(deadline, time.monotonic() + GRACE_S)
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    timed_out = any(p.exitcode is None for p in procs) and not any(p.exitcode for p in procs)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join()
    return None if timed_out else [p.exitcode for p in procs]


# ------------------------------------------------------------ train.py, and torchrun itself
def env_for(run_dir, **extra):
    """The environment of a launched job writing to run_dir."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
            "MINDDP_RUN_DIR": str(run_dir), **extra}


def wait_for_step(run_dir, step, timeout):
    """Until metrics.jsonl has `step` rows (a running job got that far)."""
    deadline = time.monotonic() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {path} after {timeout}s")


def torchrun(nproc: int, *args) -> list[str]:
    """The torchrun command line for one node: c10d rendezvous on a free local port."""
    return [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}", *map(str, args)]


def run_train(run_dir, *overrides, nproc=1, check=True, env=None, cwd=None, timeout=180, launcher="fork"):
    """train.py with these overrides on nproc ranks. launcher="fork": forked ranks (`train_py`);
    "torchrun" (nproc > 1) or "python": the command line itself, for what only a fresh
    interpreter or torchrun's agent shows."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **(env or {})}
    if run_dir is not None:
        full_env["MINDDP_RUN_DIR"] = str(run_dir)
    if launcher == "fork":
        p = train_py(overrides, nproc, full_env, cwd, timeout)
    else:
        cmd = [sys.executable] if nproc == 1 else torchrun(nproc)
        p = subprocess.run([*cmd, str(ROOT / "train.py"), *overrides], capture_output=True, text=True,
                           env=full_env, cwd=cwd or ROOT, timeout=timeout)
    if check and p.returncode != 0:
        codes = getattr(p, "returncodes", p.returncode)
        raise AssertionError(f"exit {codes}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-6000:]}")
    return p


@contextlib.contextmanager
def running_job(run_dir, *overrides, nproc=2):
    """torchrun train.py on nproc ranks, running: yields the agent (output piped into stdout);
    killed on the way out if the test left it alive."""
    agent = subprocess.Popen(torchrun(nproc, ROOT / "train.py", *overrides), cwd=ROOT, env=env_for(run_dir),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield agent
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()


def train_until_sigterm(run_dir, *overrides, rows: int, timeout: float = 120) -> str:
    """torchrun train.py on 2 ranks; once metrics.jsonl has `rows` rows, SIGTERM the agent (as
    Slurm does on preemption; torchrun passes it on). Returns the agent's output."""
    with running_job(run_dir, *overrides) as agent:
        wait_for_step(run_dir, rows, timeout)
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=120)
    return out


def ask_driver(driver, name: str, timeout_s: float) -> tuple[str, str]:
    """(status, text) of test `name` run by a torch-suite driver process (`conn`, `proc`, ...),
    which keeps torch's harness alive between tests; a driver that does not answer is killed."""
    conn, proc = driver[0], driver[1]
    assert proc.is_alive(), "the driver died in an earlier test"
    conn.send(name)
    if not conn.poll(timeout_s):
        proc.kill()
        raise AssertionError(f"{name}: no answer from the driver in {timeout_s} s")
    return conn.recv()
