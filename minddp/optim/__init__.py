"""Optimizers over the engine, one protocol (step, zero_grad, grad_norm, clip_grad_norm_,
wait_params, state_dict), whatever holds the optimizer states:

    replicated   ReplicatedOptimizer: every rank steps every parameter (torch DDP's way);
                 BucketSteps, one bucket's functional step
    overlap      OverlappedOptimizer: each bucket stepped as soon as it is reduced
    zero         ShardedOptimizer: ZeRO-1, states sharded over the data-parallel ranks
    zero_state   ZeRO-1's checkpoints as the unsharded optimizer's state dict
"""

from .overlap import OverlappedOptimizer
from .replicated import BucketSteps, ReplicatedOptimizer
from .zero import ShardedOptimizer

__all__ = ["BucketSteps", "OverlappedOptimizer", "ReplicatedOptimizer", "ShardedOptimizer"]
