"""Small helpers shared by the demos."""

import torch
import torch.distributed as dist


def print_table(title: str, row: list) -> None:
    """Gather one row per rank and let rank 0 print them as one table (no interleaving)."""
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print(title)
        for r, cells in enumerate(rows):
            print(f"  rank {r}: " + "  ".join(str(c) for c in cells))


def device() -> torch.device:
    """Where this rank's tensors live: the device the backend expects (nccl: this rank's GPU,
    which init_distributed selected from LOCAL_RANK; gloo: the CPU). Every factory call in the
    demos passes it explicitly; tests/e2e/test_demos.py runs them under a `meta` default device."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")  # gloo works on host tensors


def sync() -> None:
    """Before reading a clock on CUDA: collectives and kernels return once enqueued."""
    if device().type == "cuda":
        torch.cuda.synchronize()


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=device()).manual_seed(seed)


def as_list(t: torch.Tensor) -> list:
    return [round(v, 4) if isinstance(v, float) else v for v in t.tolist()]
