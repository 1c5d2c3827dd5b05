"""Run a function on N real gloo processes (fork: fast on CPU), surfacing every rank's error;
and the engine tests' shared reference: a small MLP, seeded batches, per-rank shards."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close


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


def run(fn, world_size: int, *args, timeout: float = 60.0) -> list:
    """Run fn(rank, world_size, *args) on world_size processes; return the results by rank.

    Raises with every rank's traceback if any rank fails, and on timeout (a hang)
    names the ranks that never answered.
    """
    results = _run(fn, world_size, args, timeout)
    errors = {r: v for r, (status, v) in results.items() if status != "ok"}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r}:\n{v}" for r, v in sorted(errors.items())))
    return [pickle.loads(results[r][1]) for r in range(world_size)]


def run_expect_errors(fn, world_size: int, *args, timeout: float = 60.0) -> dict[int, str]:
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
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hydra", "train", "tests.multiproc"]


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


# ------------------------------------------- the engine tests' model, data and comparison
B = 4  # per-rank batch


class WithBN(nn.Module):
    """A model with buffers (BatchNorm's running statistics)."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


class MLP(nn.Module):
    def __init__(self, d_in=8, width=32, d_out=4, depth=4):
        super().__init__()
        dims = [d_in] + [width] * (depth - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def batch(step, world_size, d_in=8, d_out=4, dtype=torch.float32):
    """The global batch of a step: the same on every rank, world_size * B rows."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world_size * B, d_in, generator=g, dtype=dtype)
    y = torch.randn(world_size * B, d_out, generator=g, dtype=dtype)
    return x, y


def shard(t, rank):
    return t[rank * B : (rank + 1) * B]


def params_of(model):
    m = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def assert_same_params(a, b, atol=1e-6, rtol=1e-5):
    assert a.keys() == b.keys()
    for n in a:
        assert_close(a[n], b[n], atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n}: {m}")
