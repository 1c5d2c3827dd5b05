"""minddp under Lightning (the `lightning` package, 2.6): its DDP strategies with minddp's wrapper.

    from minddp.integrations.lightning import MinddpFabricStrategy, MinddpStrategy

    trainer = lightning.Trainer(strategy=MinddpStrategy(find_unused_parameters=True), ...)
    fabric = lightning.Fabric(strategy=MinddpFabricStrategy(), ...)

Each takes what Lightning's `DDPStrategy` takes (keyword arguments go to the wrapper, as there).
Lightning binds torch's DDP class when it is imported and checks the wrapper with `isinstance`, so
`minddp.as_torch_ddp()` cannot reach it: each method of Lightning's strategy that checks torch's
class is here with minddp's, and does what Lightning's does. Manual optimization prepares the
backward from outside the forward, as with torch DDP (`model.reducer._rebuild_buckets()`,
`model.reducer.prepare_for_backward(outputs)`, and `model.reducer._delay_all_reduce()` after the
first backward of a static graph): Lightning's own code, on minddp's reducer.

This module imports lightning; nothing else in minddp does (lightning is not a dependency).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook, prepare_for_backward
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection

from .. import _compat
from ..engine.ddp import DistributedDataParallel

__all__ = ["MinddpFabricStrategy", "MinddpStrategy"]


def _wrap(module, device_ids, kwargs) -> DistributedDataParallel:
    """Lightning's construction: on a side stream where the module is on a GPU."""
    ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
    with ctx:
        return DistributedDataParallel(module=module, device_ids=device_ids, **kwargs)


# ------------------------------------------------------------------------- Trainer
class MinddpStrategy(DDPStrategy):
    """`lightning.Trainer(strategy=MinddpStrategy(...))`: Lightning's DDPStrategy, minddp's wrapper."""

    strategy_name = "minddp"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._forward_redirection = _MinddpForwardRedirection()
        self._first_static_backward_done = False

    def _setup_model(self, model) -> DistributedDataParallel:
        return _wrap(model, self.determine_ddp_device_ids(), self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda":  # Lightning registers comm hooks on GPUs only
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook,
                                    ddp_comm_wrapper=self._ddp_comm_wrapper)

    def pre_backward(self, closure_loss) -> None:
        """Manual optimization: Lightning's own preparation, on minddp's reducer."""
        manual = not self.lightning_module.automatic_optimization
        if isinstance(self.model, DistributedDataParallel) and manual:
            prepare_for_backward(self.model, closure_loss)

    def post_backward(self, closure_loss) -> None:
        """Manual optimization on a static graph: the first backward's reduction, launched here."""
        model, module = self.model, self.lightning_module
        if (isinstance(model, DistributedDataParallel) and module is not None
                and not module.automatic_optimization and model.static_graph
                and not self._first_static_backward_done):
            _compat.delay_all_reduce(model)
            self._first_static_backward_done = True

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module  # unwrap, as Lightning does for torch's
        super().teardown()


class _MinddpForwardRedirection(_ForwardRedirection):
    """Manual optimization: no backward prepared by the forward (the strategy's pre_backward does)."""

    def on_after_inner_forward(self, wrapper_module, original_module) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module, original_module) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True


# -------------------------------------------------------------------------- Fabric
class MinddpFabricStrategy(FabricDDPStrategy):
    """`lightning.Fabric(strategy=MinddpFabricStrategy(...))`: Fabric's DDPStrategy, minddp's wrapper;
    `fabric.no_backward_sync(model)` is the wrapper's `no_sync()`."""

    strategy_name = "minddp"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _MinddpBackwardSyncControl()

    def setup_module(self, module) -> DistributedDataParallel:
        return _wrap(module, self._determine_ddp_device_ids(), self._ddp_kwargs)

    def get_module_state_dict(self, module):
        return super().get_module_state_dict(_unwrapped(module))

    def load_module_state_dict(self, module, state_dict, strict: bool = True) -> None:
        super().load_module_state_dict(_unwrapped(module), state_dict, strict=strict)


class _MinddpBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module, enabled: bool):
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError("Blocking backward sync needs a module wrapped in minddp's "
                            "DistributedDataParallel (MinddpFabricStrategy.setup_module); "
                            f"got {type(module).__name__}")
        return module.no_sync()


def _unwrapped(module):
    return module.module if isinstance(module, DistributedDataParallel) else module
