"""minddp: a minimal, from-scratch data-parallel training framework for PyTorch.

Layers, each importing only those below it:

    parallel/ comm/   process groups, device mesh, tensor parallelism; collectives from scratch
    engine/           DistributedDataParallel: buckets, reductions, hooks, observer, join
    optim/            optimizers over the engine: replicated, overlapped, ZeRO-1
    perf/             cost model, memory model, sweeps: predicted and measured
    train/            the Hydra trainer
    tools/            `python -m minddp <tool>`: command lines over perf/ and train/
"""

from . import _moved
from .engine.comm_hooks import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .engine.ddp import DDP, DistributedDataParallel
from .engine.observer import CommStats
from .integrations import as_torch_ddp
from .optim.overlap import OverlappedOptimizer
from .optim.replicated import ReplicatedOptimizer
from .optim.zero import ShardedOptimizer

__all__ = [
    "DDP",
    "CommStats",
    "DistributedDataParallel",
    "GradBucket",
    "OverlappedOptimizer",
    "ReplicatedOptimizer",
    "ShardedOptimizer",
    "allreduce_hook",
    "as_torch_ddp",
    "bf16_compress_hook",
    "fp16_compress_hook",
]
__version__ = "0.6.0"  # the one place the version is written: pyproject.toml reads it
_moved.install()  # old import paths (minddp.ddp, minddp.zero, ...) for one release
