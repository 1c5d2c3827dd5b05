"""Process-group setup and teardown: who am I, which device, which backend.

SPMD: one process per device. Rank, local rank and world size come from
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE), or from Slurm's
(SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS) when `srun` starts the processes
directly; with neither, this is a world of one and `python train.py` just works.
The device follows LOCAL_RANK (cuda:LOCAL_RANK when CUDA is available) and the
backend follows the device (nccl on CUDA, gloo on CPU).
"""

from __future__ import annotations

import atexit
import gc
import os
import subprocess
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import _compat
from ..errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None


def env_ranks(env=None) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's or Slurm's environment, else (0, 0, 1)."""
    env = os.environ if env is None else env
    torchrun = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    if any(k in env for k in torchrun):
        missing = [k for k in torchrun if k not in env]
        if missing:
            raise ConfigError(
                f"incomplete launch environment: {', '.join(missing)} not set (found "
                f"{', '.join(k for k in torchrun if k in env)}). Launch with torchrun, which sets "
                "all three, or unset them to run as a single process."
            )
        return tuple(_int_env(env, k) for k in torchrun)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        # started by `srun python train.py` (one task per device), no torchrun
        return (_int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_LOCALID"),
                _int_env(env, "SLURM_NTASKS"))
    return 0, 0, 1


def env_rank(env=None) -> str:
    """This process's rank for a message ("[rank r] ..."): env_ranks' rank, and where the launch
    environment is incomplete or malformed (env_ranks' own error says so), RANK or SLURM_PROCID as
    set: the message must still be printed."""
    env = os.environ if env is None else env
    try:
        return str(env_ranks(env)[0])
    except ConfigError:
        return env.get("RANK") or env.get("SLURM_PROCID") or "0"


def select_device(local_rank: int, device: str, cuda_available: bool, device_count: int) -> torch.device:
    """The device for this process, from what is visible (pure: the counts are passed in).
    One visible GPU is this process's whatever its LOCAL_RANK: `srun --gpus-per-task=1` (or a
    per-rank CUDA_VISIBLE_DEVICES) shows each task only its own device, as cuda:0."""
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device != "cuda":
        return torch.device(device)
    if not cuda_available:
        raise RuntimeError("device=cuda requested but CUDA is not available; use device=cpu")
    if device_count == 1:
        return torch.device("cuda", 0)
    if local_rank >= device_count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but only {device_count} GPU(s) are visible: "
            "start at most one process per GPU (--nproc_per_node)"
        )
    return torch.device("cuda", local_rank)


def check_ranks_per_gpu(local_world_size: int, device_count: int, backend: str) -> None:
    """More nccl ranks on a node than visible GPUs is a launch error, on every rank alike (pure: the
    counts are passed in). NCCL refuses two ranks on one GPU only at the first collective
    ("Duplicate GPU"); gloo may share a GPU (its CUDA tensors travel through the host)."""
    if backend == "nccl" and local_world_size > device_count:
        raise ConfigError(
            f"{local_world_size} ranks on this node but {device_count} GPU(s) visible: nccl needs one GPU "
            f"per rank. Start at most {device_count} (torchrun --nproc_per_node={max(device_count, 1)}, "
            "make ... NPROC=), or run on the CPU (device=cpu / --backend gloo)")


def local_world_size(env=None) -> int:
    """Ranks on this node that share its visible GPUs: torchrun's LOCAL_WORLD_SIZE; 1 otherwise
    (srun --gpus-per-task shows each task its own GPU; a LOCAL_RANK beyond the visible count is
    select_device's error)."""
    env = os.environ if env is None else env
    return _int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1


def pick_device(local_rank: int, device: str = "auto") -> torch.device:
    available = torch.cuda.is_available()
    return select_device(local_rank, device, available, torch.cuda.device_count() if available else 0)


def backend_for(device: torch.device) -> str:
    """The backend follows the device: nccl for CUDA tensors, gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def _slurm_master_addr(env) -> str:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise RuntimeError("MASTER_ADDR is not set: export MASTER_ADDR (the head node) and MASTER_PORT")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                         check=True)
    return out.stdout.split()[0]


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Initialise the default process group (idempotent) and return who this process is."""
    rank, local_rank, world_size = env_ranks()
    if (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        warnings.warn(
            "torchrun restarted this worker group with the rendezvous TCPStore shared across rounds; "
            "in torch 2.13 the new group can read the previous round's addresses and fail to connect "
            "(pytorch#135712). Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.", stacklevel=2)
    if device in ("auto", "cuda") and torch.cuda.is_available():  # nccl: before any rank picks a GPU,
        # so every entry point (trainer, tools, demos) gives every rank the same error at start-up
        check_ranks_per_gpu(local_world_size(), torch.cuda.device_count(), "nccl")
    dev = pick_device(local_rank, device)
    backend = backend_for(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            # a world of one needs no rendezvous: an in-memory store
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        else:
            if "MASTER_ADDR" not in os.environ:  # srun without torchrun
                os.environ["MASTER_ADDR"] = _slurm_master_addr(os.environ)
            if "MASTER_PORT" not in os.environ:
                job = int(os.environ.get("SLURM_JOB_ID", "0"))
                os.environ["MASTER_PORT"] = str(29500 + job % 1000)
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        atexit.unregister(_shutdown_at_exit)  # once, however often a process group is made
        atexit.register(_shutdown_at_exit)
    return DistInfo(rank, local_rank, world_size, dev, backend)


def _shutdown_at_exit() -> None:
    """For a script that ends without destroy_process_group: gloo's threads still hold the last
    collectives' work, and freed during the interpreter's teardown it aborts the process
    ("terminate called without an active exception", pytorch#179291: 3 of 6 two-rank runs of
    README's snippet here, 0 of 12 with this). Destroyed while Python is still whole; not after
    an uncaught exception, when peers may be inside a collective that destroying would wait on."""
    import sys

    if getattr(sys, "last_value", None) is not None:
        return
    shutdown()
    gc.collect()


def exit_worker(code: int = 0, script: bool = False) -> None:
    """A torchrun worker whose run finished (everything saved, the process group destroyed)
    leaves without the interpreter's teardown. There, with torch's flight recorder on, C++
    static destructors occasionally abort ("terminate called without an active exception",
    exit -6: 2 of about 80 torchrun runs in one test-suite run here), and torchrun would
    report a finished run as failed. `script=True` (train.py's own entry) does the same
    outside torchrun, where a plain `python train.py` hit the same abort (1 in ~560 tests);
    otherwise outside torchrun: a normal exit."""
    if script or "TORCHELASTIC_RUN_ID" in os.environ:
        import logging
        import sys

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wait_for_peers(key: str, timeout_s: float = 30.0) -> None:
    """Before exiting on an error every rank hits (a bad config), wait until all ranks have
    reported it, so torchrun does not kill the slower ranks before they print their own
    message, then until one agreed instant, so all exit together (exit at once after it).
    Uses the process group's store, or torchrun's; gives up after timeout_s."""
    import time
    from datetime import timedelta

    try:
        _, _, world = env_ranks()
        if world <= 1 or "MASTER_ADDR" not in os.environ:
            return
        if dist.is_initialized():
            store = _compat.default_store()
        else:  # before init_process_group: torchrun's store (or rank 0 hosts one)
            host = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ.get("RANK") == "0"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=host, timeout=timedelta(seconds=timeout_s))
        if store.add(key, 1) == world:  # the last to report names one instant for all to leave at:
            store.set(f"{key}/leave_at", str(time.time() + 0.2))  # torchrun kills who is left behind
        store.wait([f"{key}/leave_at"], timedelta(seconds=timeout_s))
        time.sleep(max(0.0, float(store.get(f"{key}/leave_at")) - time.time()))
    except Exception:  # noqa: BLE001 - best effort: never turn an error report into a hang
        pass
