"""The data-parallel engine: torch DDP's reducer, in Python. One iteration, and the file of each
phase (the only place it is told):

1. forward, `ddp.py`: broadcast the buffers (when torch would); run the module; then, if grad
   is enabled outside `no_sync()`, `reducer.prepare_for_backward(output)` starts an `Iteration`
   (`iteration.py`: one backward's state, and the only code that changes it), makes every
   `.grad` its bucket view (`grads.py`: None pointed at the zeroed view, a no_sync() gradient
   moved in; autograd then adds into the bucket) and puts a prehook on the output's autograd
   nodes: the backward of *this* graph ends the iteration.
2. mark ready, `reducer.py`, from post-accumulate-grad hooks (`hooks.py`): in the first
   iteration (and where the rules need each gradient: static_graph, find_unused_parameters,
   sparse, mixed precision, a graph whose order changes) one per parameter, `autograd_hook`,
   `Iteration.mark_ready` counting its bucket down; from then on one per bucket, on the
   gradient observed to arrive last, `bucket_hook`: the bucket's buffer version counter says
   whether every gradient of it arrived (each in-place add moves it by one).
3. launch in order, `reducer.py` (`launch_ready_buckets`): bucket b goes out once it and every
   bucket before it are complete, strictly in index order on every rank. Gradients that came as
   tensors of their own (`.grad` set to None after the forward) land in it with one
   `torch._foreach_copy_` and `.grad` becomes the view (`grads.py`, the only writer of
   `.grad`); the reduction starts it (`reductions.py`: all-reduce, 16-bit, comm hook, ZeRO-1's
   reduce-scatter; `communicator.py`: the 1/n scaling of the whole bucket and the backend's or
   a hand-written all-reduce).
4. finalize, `reducer.py` (`finalize_backward`, queued once on the autograd engine): launch
   what is left (unused parameters' buckets, `overlap=False`, a static graph's first
   iteration), wait for every bucket in order, write back what `.grad` must hold (`grads.py`),
   send the usage flags home without a wait (`usage.py`), drop the iteration. After the first
   iteration the buckets are rebuilt once in rank 0's observed gradient-ready order (`buckets.py`)
   and the hooks chosen (`Reducer._choose_hooks`).

Beside the iteration, each a seam the reducer calls through its public methods:

    buckets          pure: which parameters share a bucket; the immutable Layout of flat buffers
    options          DDP's options, held once (frozen), with torch's derived bucket attributes
    ddp_api          what a script sees beside the step: torch DDP's attributes, logging data,
                     comm_stats, bucket_assignment
    checks           arguments and the model checked before anything is built, each error naming the fix
    replicas         which tensors travel to keep replicas equal (init sync, each forward's buffers)
    usage            unused-parameter flags, riding in the last dense bucket, read without a host wait
    mixed_precision  torch's mixed_precision: forward in param_dtype, reduce in reduce_dtype
    comm_hooks       torch-style comm hooks: GradBucket and the built-in hooks
    transfer         host <-> device copies that never block the host
    observer         CommStats, the trace and profiler ranges: it listens, per bucket, never wraps
    join             uneven inputs: a rank out of data shadows the others' collectives
    pickling         torch.save / deepcopy of the wrapper, as torch DDP's

Layers, one way: minddp.parallel and minddp.comm below, minddp.optim above.
"""

from .ddp import DDP, DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel"]
