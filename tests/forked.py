"""train.py on N forked processes: `python train.py` or torchrun's workers without the
interpreter's start-up (3 s a process here, most of a short test run).

Each rank is forked from a clean fork server that has imported torch, Hydra and train.py, gets
the environment torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and runs train.py as `python train.py` does (runpy), from Hydra's parsing
to its exit code; all ranks write to one stdout and one stderr, as under torchrun. What only
the agent does (restarts, passing on signals, its failure summary, TORCHELASTIC_* variables)
is tested with torchrun itself.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.multiproc import forkserver, free_port

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10.0  # after a rank fails, how long the others get to report before they are killed


def _rank_main(argv, env, cwd, out_path, err_path) -> None:
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
    sys.argv = [str(ROOT / "train.py"), *argv]
    code = 1
    try:  # as `python train.py` runs it (Hydra finds conf/ beside the __main__ file)
        runpy.run_path(sys.argv[0], run_name="__main__")  # a run ends in os._exit (exit_worker)
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


def train_py(argv, nproc=1, env=None, cwd=None, timeout=180.0) -> subprocess.CompletedProcess:
    """Run train.py with `argv` on nproc ranks; returncode is 0, else the lowest failed rank's
    code (a signal: minus its number); `returncodes` holds every rank's."""
    env = dict(os.environ if env is None else env)
    if nproc > 1:
        env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    ctx = forkserver()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch(), err.touch()
        procs = []
        for rank in range(nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if nproc > 1 else env
            procs.append(ctx.Process(target=_rank_main, args=(list(argv), rank_env, str(cwd or ROOT),
                                                               str(out), str(err))))
            procs[-1].start()
        codes = _wait(procs, timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    cmd = ["train.py", *argv]
    if codes is None:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    p = subprocess.CompletedProcess(cmd, next((c for c in codes if c), 0), stdout, stderr)
    p.returncodes = codes
    return p


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
