"""Model FLOPs utilisation (MFU): achieved training FLOP/s over the hardware's peak.

FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B):

    6 * N  +  12 * n_layer * n_embd * block_size

6N counts the matmuls of forward (2N) and backward (4N) over the N parameters that
multiply activations (every parameter except the position embedding: a lookup);
the second term is attention's QK^T and AV products (n_heads * head_dim = n_embd),
which no parameter count sees. Recomputation is not counted: this is *model* FLOPs.

MFU is reported for the whole job: tokens/s of the global batch x FLOPs per token,
over the peak of one device x the number of processes (dp x tp).
"""

from __future__ import annotations

import time

import torch

# dense bf16 tensor-core peaks, TFLOP/s per GPU (vendor data sheets, without sparsity); the
# first key found in torch.cuda.get_device_name wins, so the specific variants come first
KNOWN_PEAKS_TFLOPS = {
    "GH200": 989.0,  # GH200 Grace Hopper (H100 SXM-class GPU)
    "H200 NVL": 835.0,  # H200 NVL (PCIe card)
    "H200": 989.0,  # H200 SXM
    "H100 NVL": 835.0,  # H100 NVL (PCIe pair card)
    "H100 PCIe": 756.0,  # H100 PCIe
    "H100": 989.0,  # H100 SXM5 (name "NVIDIA H100 80GB HBM3")
    "H800 PCIe": 756.0,
    "H800": 989.0,
    "B200": 2250.0,  # HGX B200 per GPU
    "A100-PCIE": 312.0,  # A100 40/80 GB PCIe: same dense bf16 peak as SXM
    "A100": 312.0,  # A100 SXM4
    "A800": 312.0,
    "L40S": 362.0,
    # other GPUs are measured (measured_peak_tflops); a CPU has no MFU unless train.peak_tflops is set
}


def flops_per_token(model_cfg, num_params: int) -> float:
    """Training FLOPs per token; `num_params` is the full model's (unsharded) count."""
    n_embd = model_cfg.n_embd
    if model_cfg.name == "gpt":
        n = num_params - model_cfg.block_size * n_embd  # the position embedding is a lookup
        return 6.0 * n + 12.0 * model_cfg.n_layer * n_embd * model_cfg.block_size
    n = num_params - model_cfg.vocab_size * n_embd  # the MLP's token embedding is a lookup
    return 6.0 * n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_peak_tflops(device: torch.device, seconds: float = 0.05, repeats: int = 5,
                         n: int | None = None) -> float:
    """Matmul FLOP/s this process reaches: the best of `repeats` timed windows, each closed by a
    synchronise (CUDA returns at enqueue), in the dtype training computes in (bf16 on CUDA)."""
    n = n or (4096 if device.type == "cuda" else 512)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm up
    _sync(device)
    best = 0.0
    for _ in range(repeats):
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            reps += 1
            _sync(device)  # per matmul: the clock reads finished work
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12)
    return best


def table_peak(device_name: str) -> float | None:
    """The data-sheet peak for a torch.cuda.get_device_name, or None (then it is measured)."""
    return next((v for k, v in KNOWN_PEAKS_TFLOPS.items() if k in device_name), None)


def peak_tflops(device: torch.device, configured: float | None = None) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number comes from); NaN on a CPU without
    train.peak_tflops: a matmul timed there moves with whatever else runs (19-95% MFU from one
    run to the next under load), and an MFU that measures the neighbours is worse than none."""
    if configured:
        return float(configured), "train.peak_tflops"
    if device.type != "cuda":
        return float("nan"), "none known on cpu"
    name = torch.cuda.get_device_name(device)
    if table_peak(name):
        return table_peak(name), f"{name} bf16 dense"
    return measured_peak_tflops(device), f"measured {name} matmul (best of 5)"


def peak_phrase(job_peak_tflops: float | None) -> str:
    """The run header's words for the peak MFU is computed against."""
    if job_peak_tflops is None or not job_peak_tflops > 0:
        return "no MFU (no known peak: train.peak_tflops=N sets one)"
    return f"peak {job_peak_tflops:.3g} TFLOP/s"


def utilisation(tokens_per_s: float, flops_token: float, peak_device_tflops: float,
                num_devices: int) -> tuple[float, float | None]:
    """(achieved TFLOP/s of the job, MFU of the job, or None where the peak is unknown). An MFU
    above 1 means the peak was underestimated (a measured peak on a loaded CPU), not a record: it
    is never reported, only None."""
    tflops = tokens_per_s * flops_token / 1e12
    if peak_device_tflops is None or not peak_device_tflops > 0:  # NaN: some rank's peak unknown
        return tflops, None
    mfu = tflops / (peak_device_tflops * num_devices)
    return tflops, mfu if 0 < mfu <= 1 else None


def autocast_bf16(bf16: bool | None, device: torch.device) -> bool:
    """Whether to autocast to bf16: train.bf16 true or false, or null (the default): on CUDA
    devices that support it."""
    if bf16 is None:
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return bool(bf16)


def set_tf32(enabled: bool, device: torch.device) -> None:
    """train.tf32 on CUDA: fp32 matmuls and convolutions on TF32 tensor cores (torch's own
    process-wide flags, so the trainer sets them once, visibly, in its setup); no effect on CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
