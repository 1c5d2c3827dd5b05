"""minddp: a minimal, from-scratch data-parallel training framework for PyTorch."""

from .comm_hooks import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .ddp import DDP, DistributedDataParallel
from .observer import CommStats
from .optim import ReplicatedOptimizer
from .overlap import OverlappedOptimizer
from .zero import ShardedOptimizer

__all__ = [
    "DDP",
    "CommStats",
    "DistributedDataParallel",
    "GradBucket",
    "OverlappedOptimizer",
    "ReplicatedOptimizer",
    "ShardedOptimizer",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
]
__version__ = "0.4.0"
