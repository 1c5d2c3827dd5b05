"""GPU smoke check (nccl, bf16): run on a machine with CUDA, not part of the CPU test suite.

    torchrun --standalone --nproc_per_node=<gpus> scripts/gpu_check.py

Checks, on every rank: the device follows LOCAL_RANK and the backend is nccl; minddp's
gradients equal torch DDP's on the same model and data (fp32, and bf16 compression close);
a bf16-autocast step runs. Prints one line per check on rank 0 and exits non-zero on failure.
"""

import copy
import os

import torch
import torch.distributed as dist
from torch import nn

import minddp
from minddp.dist import init_distributed, shutdown


def main() -> None:
    info = init_distributed()
    assert info.device == torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), info
    assert info.backend == "nccl", info
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(info.device)
    x = torch.randn(8, 64, device=info.device) + info.rank
    results = {}
    for name, kwargs in {"fp32": {}, "bf16": {"compress": "bf16"}}.items():
        ours = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=0.01, **kwargs)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[info.local_rank])
        for m in (ours, theirs):
            m(x).square().mean().backward()
        err = max((a.grad - b.grad).abs().max().item()
                  for a, b in zip(ours.module.parameters(), theirs.module.parameters()))
        results[name] = err
    assert results["fp32"] < 1e-5 and results["bf16"] < 5e-2, results
    model = minddp.DDP(copy.deepcopy(base))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    dist.barrier()
    if info.rank == 0:
        print(f"gpu check ok on {info.world_size} x {torch.cuda.get_device_name()}: "
              f"max |grad - torch DDP| fp32 {results['fp32']:.2e}, bf16-compressed {results['bf16']:.2e}")
    shutdown()


if __name__ == "__main__":
    main()
