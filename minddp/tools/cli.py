"""Start-up shared by the command-line tools (bench, bench_ddp, bench_trainer, bench_debug,
timeline, scaling): threads, core pinning, the process group on the right device. Timing is
minddp.perf.clock's and the headless matplotlib minddp.perf.plot's, for every tool; how a tool
declares and checks its arguments, minddp.tools.arguments."""

from __future__ import annotations

import os

import torch

from ..parallel.agent import stop_with_agent
from ..parallel.dist import DistInfo, init_distributed
from ..perf.clock import timing_strategy  # noqa: F401  (how the tools' reports say they timed)
from ..perf.plot import pyplot  # noqa: F401  (the one headless matplotlib)
from .arguments import parse_size  # noqa: F401  (sizes on the command line: minddp.tools.arguments)

BACKEND_DEVICE = {"auto": "auto", "gloo": "cpu", "nccl": "cuda"}


def pin_to_core() -> None:
    """One rank per core: no two ranks time-share a core, and no migration noise."""
    cores = sorted(os.sched_getaffinity(0))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    os.sched_setaffinity(0, {cores[local % len(cores)]})


def start(backend: str = "auto", pin: bool = False) -> DistInfo:
    """Threads from OMP_NUM_THREADS, the process group whose backend follows the device
    (`cuda:LOCAL_RANK` with nccl, else CPU with gloo), and with `pin` each CPU rank on a core of
    its own. GPU ranks are never pinned: NCCL's proxy, the watchdog and autograd's device
    thread would share that one core."""
    if backend not in BACKEND_DEVICE:
        raise SystemExit(f"--backend must be one of {', '.join(BACKEND_DEVICE)}, got {backend!r}")
    stop_with_agent()  # under torchrun: a worker whose agent died stops
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    on_gpu = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
    if pin and not on_gpu:  # before the process group: its threads inherit the core
        pin_to_core()
    return init_distributed(BACKEND_DEVICE[backend])


def ranks_phrase(world: int, device: torch.device) -> str:
    """How the ranks of a measurement ran, for its report."""
    if device.type == "cuda":
        return f"{world} nccl ranks, one {torch.cuda.get_device_name(device)} each"
    return f"{world} gloo ranks pinned to a core each, {torch.get_num_threads()} thread(s)"
