"""The data-parallel engine: torch DDP's reducer, in Python. Read one iteration in this order:
`ddp` (the wrapper's forward), `reducer` (the four phases), `iteration` (what lives for one
backward), `buckets` (where each gradient lives), `reductions` and `communicator` (how a bucket
goes out); each other module is one seam beside them, called through its public interface.

    ddp              the wrapper, a thin nn.Module: forward (buffer sync, starts an iteration),
                     no_sync, join, _set_static_graph; its docstring follows one iteration
    reducer          the one reducer, in torch's phases and names: prepare_for_backward,
                     autograd_hook / mark_variable_ready, launch_ready_buckets (index order),
                     finalize_backward (queued once): it creates and drops each Iteration
    iteration        one backward as a value: used and ready flags, hooks still to come, each
                     bucket's pending count, started collective and unused list, the next bucket
    buckets          pure: which parameters share a bucket; the immutable Layout of flat buffers
    reductions       how a bucket is reduced: all-reduce, 16-bit, comm hook, ZeRO-1's reduce-scatter;
                     a launch returns what it started (future and Work together)
    communicator     how one tensor is all-reduced: the group, the average's 1/n, the algorithm
    comm_hooks       torch-style comm hooks: GradBucket and the built-in hooks
    options          DDP's options, held once (frozen), with torch's derived bucket attributes
    ddp_api          what a script sees beside the step: torch DDP's attributes, logging data,
                     comm_stats, bucket_assignment
    hooks            the gradient hooks and who owns a module: one live wrapper per module
    checks           arguments and the model checked before anything is built, each error naming the fix
    replicas         which tensors travel to keep replicas equal (init sync, each forward's buffers)
    usage            unused-parameter flags, riding in the last dense bucket, read without a host wait
    mixed_precision  torch's mixed_precision: forward in param_dtype, reduce in reduce_dtype
    transfer         host <-> device copies that never block the host
    observer         CommStats, the trace and profiler ranges: it listens, never wraps
    join             uneven inputs: a rank out of data shadows the others' collectives
    pickling         torch.save / deepcopy of the wrapper, as torch DDP's

Layers, one way: minddp.parallel and minddp.comm below, minddp.optim above.
"""

from .ddp import DDP, DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel"]
