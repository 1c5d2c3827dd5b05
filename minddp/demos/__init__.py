"""Runnable, checked textbook demos: `torchrun --nproc_per_node=N -m minddp.demos NAME`.

Each module has a `run()` that works on the already-initialised default process group,
prints what it shows (rank 0 prints tables) and asserts the closed form the text predicts.
"""

DEMOS = {
    "spmd": "every rank reports rank / local rank / world size; all-reduce gives n(n-1)/2",
    "collectives": "the six collectives on small tensors, checked against their closed forms",
    "async": "all-reduce with async_op=True overlapped with a matmul, against the blocking version",
    "ring_exchange": "send to rank+1, receive from rank-1: batch_isend_irecv and parity ordering",
    "moe_dispatch": "tokens to experts with all_to_all (uneven splits) and back, in order",
    "manual_all_reduce": "all-reduce = reduce-scatter + all-gather, equal to dist.all_reduce",
    "hierarchical": "reduce in node, all-reduce among leaders, broadcast in node",
    "deadlock": "the forbidden conditional collective becomes a clear timeout error, then the fix",
    "minimal_ddp": "the textbook DDP loop by hand next to minddp.DistributedDataParallel",
}

# the demo's name on the command line -> its module (`async` is a Python keyword)
MODULES = {name: ("async_overlap" if name == "async" else name) for name in DEMOS}
