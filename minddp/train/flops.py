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

# dense bf16 tensor-core peaks, TFLOP/s per GPU (vendor data sheets, without sparsity)
KNOWN_PEAKS_TFLOPS = {
    "H200": 989.0,  # NVIDIA H200 SXM data sheet
    "H100": 989.0,  # NVIDIA H100 SXM5 data sheet (PCIe: 756)
    "A100": 312.0,  # NVIDIA A100 data sheet
}


def flops_per_token(model_cfg, num_params: int) -> float:
    """Training FLOPs per token; `num_params` is the full model's (unsharded) count."""
    n_embd = model_cfg.n_embd
    if model_cfg.name == "gpt":
        n = num_params - model_cfg.block_size * n_embd  # the position embedding is a lookup
        return 6.0 * n + 12.0 * model_cfg.n_layer * n_embd * model_cfg.block_size
    n = num_params - model_cfg.vocab_size * n_embd  # the MLP's token embedding is a lookup
    return 6.0 * n


def measured_peak_tflops(device: torch.device, seconds: float = 0.1, n: int = 512) -> float:
    """Matmul FLOP/s this process reaches on its own threads (the CPU's practical peak)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # warm up
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def peak_tflops(device: torch.device, configured: float | None = None) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number comes from)."""
    if configured:
        return float(configured), "train.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in KNOWN_PEAKS_TFLOPS.items():
            if key in name:
                return value, f"{name} bf16 dense"
    return measured_peak_tflops(device), f"measured {device.type} matmul"


def utilisation(tokens_per_s: float, flops_token: float, peak_device_tflops: float,
                num_devices: int) -> tuple[float, float]:
    """(achieved TFLOP/s of the job, MFU of the job)."""
    tflops = tokens_per_s * flops_token / 1e12
    return tflops, tflops / (peak_device_tflops * num_devices)
