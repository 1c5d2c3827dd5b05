"""The data-parallel engine: torch DDP's reducer, in Python. `reducer` is the iteration, `ddp` the
wrapper around it; each other module is one seam beside them, called through its public interface.

    ddp          the wrapper, a thin nn.Module: forward (buffer sync, starts an iteration), no_sync,
                 join, hook registration; its docstring follows one iteration through the reducer
    reducer      one object owning the buckets and the iteration, in torch's phases: prepare for
                 backward, mark ready, launch in index order, finalize (queued once), each
                 per-iteration flag named for the torch rule it encodes
    ddp_api      what a script sees beside the step: torch DDP's arguments and attributes,
                 no_sync, comm hooks, comm_stats, pickling hooks
    checks       arguments and the model checked before anything is built, each error naming the fix
    replicas     which tensors travel to keep replicas equal (init sync, each forward's buffers)
    buckets      pure: which parameters share a bucket, flat buffers and gradient views
    reductions   how a bucket is reduced: all-reduce, 16-bit, comm hook, ZeRO-1's reduce-scatter
    comm_hooks   the reducer (native or a from-scratch algorithm) and torch-style comm hooks
    usage        unused-parameter flags, riding in the last dense bucket, read without a host wait
    transfer     host <-> device copies that never block the host
    observer     CommStats, the trace and profiler ranges (host clock, or CUDA events on nccl)
    join         uneven inputs: a rank out of data shadows the others' collectives
    pickling     torch.save / deepcopy of the wrapper, as torch DDP's

Layers, one way: minddp.parallel and minddp.comm below, minddp.optim above.
"""

from .ddp import DDP, DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel"]
