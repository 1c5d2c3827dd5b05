"""Commands on N forked processes: `python train.py`, `minddp <tool>`, or torchrun's workers,
without the interpreter's start-up (3 s a process here, most of a short test run).

Each rank is forked from a clean fork server that has imported torch, Hydra and train.py, gets
the environment torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and runs the script or module as `python` would (runpy: train.py as
__main__, from Hydra's parsing to its exit code); all ranks write to one stdout and one
stderr, as under torchrun. What only the agent does (restarts, passing on signals, its failure
summary, TORCHELASTIC_* variables) is tested with torchrun itself.
"""

from __future__ import annotations

import os
import runpy
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.multiproc import forkserver, free_port

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10.0  # after a rank fails, how long the others get to report before they are killed


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


def run(argv, nproc=1, env=None, cwd=None, timeout=180.0) -> subprocess.CompletedProcess:
    """Run argv (what follows `python`) on nproc ranks; returncode is 0, else the lowest failed
    rank's code (a signal: minus its number); `returncodes` holds every rank's."""
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
    return run([str(ROOT / "train.py"), *overrides], nproc, env, cwd, timeout)


def command(line: str, env=None, cwd=None, timeout=180.0) -> subprocess.CompletedProcess:
    """A documented command line: `torchrun [--standalone] --nproc_per_node=N <script | -m mod> ...`,
    `python <script | -m mod> ...` or `minddp <tool> ...`."""
    words = shlex.split(line)
    if words[0] == "minddp":
        return run(["-m", "minddp", *words[1:]], 1, env, cwd, timeout)
    if words[0] == "python":
        return run(words[1:], 1, env, cwd, timeout)
    assert words[0] == "torchrun", line
    nproc, rest = 1, words[1:]
    while rest[0].startswith("--"):
        if rest[0].startswith(("--nproc_per_node=", "--nproc-per-node=")):
            nproc = int(rest[0].split("=", 1)[1])
        elif rest[0] != "--standalone":
            raise ValueError(f"{rest[0]}: only --standalone and --nproc_per_node are run forked")
        rest = rest[1:]
    return run(rest, nproc, env, cwd, timeout)


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
