"""minddp inside libraries that build torch's DDP themselves.

The Hugging Face `Trainer` (through accelerate) calls `torch.nn.parallel.DistributedDataParallel(model,
...)` itself; `as_torch_ddp()` puts minddp's class under that name for the duration of a block:

    with minddp.as_torch_ddp():
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()

Lightning binds torch's class when it is imported, so a swap cannot reach it: its strategies are
minddp.integrations.lightning (imported only by whoever uses it: lightning is not a dependency).

minddp's own code never reads torch's class by that name (minddp._compat.TORCH_DDP, taken at import).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.nn.parallel

from .. import _compat
from ..engine.ddp import DistributedDataParallel


@contextmanager
def as_torch_ddp():
    """minddp's DistributedDataParallel under torch's public name,
    `torch.nn.parallel.DistributedDataParallel`, inside the block; torch's class again after it, also
    when the block raises. Yields minddp's class.

    Only the public name: torch's own module (`torch.nn.parallel.distributed`) keeps its class, which
    torch DDP's forward and dynamo read, so a torch DDP still works inside the block. Build *and* train
    inside it: a library that checks or unwraps the wrapper by that name (accelerate's `no_sync`,
    `unwrap_model`) recognises minddp's wrapper only there."""
    _compat.import_torch_ddp_binders()
    saved = torch.nn.parallel.DistributedDataParallel
    torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
    try:
        yield DistributedDataParallel
    finally:
        torch.nn.parallel.DistributedDataParallel = saved
