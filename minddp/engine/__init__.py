"""The data-parallel engine: torch DDP's reducer, in Python. `ddp` is the step; each other
module is one seam beside it, and the engine calls only the seam's interface.

    ddp          the wrapper's step: forward (buffer sync), per-gradient hooks, bucket launch,
                 the end-of-backward wait and the one-off bucket rebuild
    ddp_api      what a script sees beside the step: torch DDP's arguments and attributes,
                 no_sync, comm hooks, comm_stats, pickling hooks
    checks       arguments and the model checked before anything is built, each error naming the fix
    replicas     which tensors travel to keep replicas equal (init sync, each forward's buffers)
    buckets      pure: which parameters share a bucket, flat buffers and gradient views
    reductions   how a bucket is reduced: all-reduce, 16-bit, comm hook, ZeRO-1's reduce-scatter
    comm_hooks   the reducer (native or a from-scratch algorithm) and torch-style comm hooks
    usage        unused-parameter flags, riding in the last bucket, read without a host wait
    transfer     host <-> device copies that never block the host
    observer     CommStats, the trace and profiler ranges (host clock, or CUDA events on nccl)
    join         uneven inputs: a rank out of data shadows the others' collectives
    pickling     torch.save / deepcopy of the wrapper, as torch DDP's

Layers, one way: minddp.parallel and minddp.comm below, minddp.optim above.
"""

from .ddp import DDP, DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel"]
