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


def as_list(t: torch.Tensor) -> list:
    return [round(v, 4) if isinstance(v, float) else v for v in t.tolist()]
