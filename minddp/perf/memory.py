"""Memory per rank: what a data-parallel setup holds by construction (one model, read by
`minddp costmodel zero` and `minddp bench-memory`), and what a run measured (`PeakMeter`).

The model, per rank, for n parameters: weights + separate gradients + bucket buffers (the
gradients themselves where they are bucket views) + optimizer states, the states divided by
dp where sharded (ZeRO-1). AdamW keeps exp_avg and exp_avg_sq: 8 B per fp32 parameter.
"""

from __future__ import annotations

import resource

import torch

# what each bench-memory configuration holds per rank, in units of P (the fp32 parameter
# bytes): (weights, separate gradients, bucket buffers, states sharded, the table's words)
HOLDS = {
    "local": (1, 1, 0, False, "params P, grads P, states 2P"),
    "torch-ddp": (1, 1, 1, False, "params P, grads P, buckets P, states 2P"),
    "torch-ddp-view": (1, 0, 1, False, "params P, grads = bucket views P, states 2P"),
    "minddp-ddp": (1, 0, 1, False, "params P, grads = bucket views P, states 2P"),
    "minddp-zero1": (1, 0, 1, True, "params P (flat buffers), grads = bucket views P, states 2P/dp"),
    "torch-zero": (1, 1, 1, True, "params P, grads P, buckets P, states 2P/dp"),
    "minddp-overlap": (1, 0, 1, False, "params P, grads = bucket views P, states 2P"),
}


def memory_per_rank(n_params: float, dp: int, weight_bytes: float = 4, grad_bytes: float = 4,
                    state_bytes: float = 8, sharded: bool = False, bucket_bytes: float = 0) -> dict:
    """Bytes per rank: weights + gradients + bucket buffers + optimizer states (AdamW: 8 B per
    fp32 parameter), the states divided by dp under ZeRO-1. Bytes are per parameter; bucket
    buffers default to none (the gradients are the bucket views)."""
    states = n_params * state_bytes / (dp if sharded else 1)
    w, g, b = n_params * weight_bytes, n_params * grad_bytes, n_params * bucket_bytes
    return {"weights": w, "gradients": g, "buckets": b, "optimizer_states": states,
            "total": w + g + b + states}


def modeled_bytes(config: str, param_bytes: int, dp: int) -> dict:
    """What one rank of a bench-memory configuration (HOLDS) holds, for `param_bytes` of fp32
    parameters: the model above in the table's units."""
    params, grads, buckets, sharded, _ = HOLDS[config]
    m = memory_per_rank(param_bytes / 4, dp, 4 * params, 4 * grads, 8, sharded, 4 * buckets)
    return {"params": m["weights"], "grads": m["gradients"], "buckets": m["buckets"],
            "states": m["optimizer_states"], "total": m["total"]}


def state_bytes(opt) -> int:
    """Optimizer state held on this rank (minddp's optimizers and ZeroRedundancyOptimizer keep the
    torch optimizer, a shard's under ZeRO-1, in .optim)."""
    inner = getattr(opt, "optim", opt)
    return sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


class PeakMeter:
    """Peak memory since construction: VmHWM (reset at start) or ru_maxrss on CPU, the
    allocator's max_memory_allocated on CUDA (after `on(device)`)."""

    def __init__(self):
        self.device = None
        self.reset = _reset_hwm()
        self.baseline = _rss_bytes()
        self.method = "VmHWM - RSS after import" if self.reset else "ru_maxrss - RSS after import"

    def on(self, device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline, self.method = torch.cuda.memory_allocated(device), "cuda max_memory_allocated"

    def peak(self) -> int:
        """Bytes above the baseline at the highest point so far."""
        if self.device is not None and self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _hwm_bytes(self.reset) - self.baseline

    def absolute(self) -> int:
        return self.peak() + self.baseline


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: VmHWM := VmRSS
        return True
    except OSError:
        return False


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def _rss_bytes() -> int:
    try:
        return _status_kb("VmRSS:") * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hwm_bytes(reset: bool) -> int:
    if reset:
        return _status_kb("VmHWM:") * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
