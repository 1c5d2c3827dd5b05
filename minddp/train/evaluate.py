"""Validation loss: exact, for any number of data-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from .data.batches import collate
from .metrics import flight_recorder


@torch.no_grad()
def evaluate(model, val_set, mesh, t, device: torch.device, autocast) -> float:
    """Exact mean token loss over the first t.eval_samples validation windows (all if 0): rank r
    takes windows r, r+dp, ... (no padding, nothing counted twice); sums and counts are
    all-reduced. The unwrapped model is used, so ranks may run different numbers of batches."""
    flight_recorder.set_context(phase="evaluate")
    n = len(val_set) if t.eval_samples <= 0 else min(len(val_set), t.eval_samples)
    mine = list(range(mesh.dp_rank, n, mesh.dp_size))
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for s in range(0, len(mine), t.micro_batch_size):
        x, y = collate(val_set, mine[s : s + t.micro_batch_size], device)
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
        total[0] += loss.double()
        total[1] += y.numel()
    dist.all_reduce(total, group=mesh.dp_group)
    model.train()
    return (total[0] / total[1]).item()
