"""Old import paths, kept for one release (0.4.0 moved the modules into folders; README "What
moved"): `import minddp.ddp` or `from minddp.zero import ShardedOptimizer` is the module at its
new home (the same module object, so patching one patches the other), with a DeprecationWarning.
`minddp.optim` is a package now and re-exports what `minddp/optim.py` held.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    "ddp": "engine.ddp", "ddp_api": "engine.ddp_api", "ddp_checks": "engine.checks",
    "pickling": "engine.pickling", "replicas": "engine.replicas", "buckets": "engine.buckets",
    "reductions": "engine.reductions", "comm_hooks": "engine.comm_hooks", "observer": "engine.observer",
    "usage": "engine.usage", "transfer": "engine.transfer", "join": "engine.join",
    "overlap": "optim.overlap", "zero": "optim.zero", "zero_state": "optim.zero_state",
    "dist": "parallel.dist", "mesh": "parallel.mesh", "tensor_parallel": "parallel.tensor_parallel",
    "gradnorm": "parallel.gradnorm", "collectives": "comm.collectives", "costmodel": "perf.costmodel",
}
# 0.3's minddp.costmodel also held its command line's helpers, now minddp.tools.costmodel's
COSTMODEL_CLI = ("parse_size", "explain_all_reduce", "explain_hierarchical", "explain_tree",
                 "explain_zero", "inter_node_bytes")


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `minddp.<old>` and loads it as the module at its new home."""

    def __init__(self):
        self._own_specs: dict = {}  # old name -> the module's own spec, until exec_module

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, old = fullname.rpartition(".")
        if pkg != "minddp" or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = "minddp." + MOVED[spec.name.rpartition(".")[2]]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        if new == "minddp.perf.costmodel":
            return _old_costmodel(spec.name)
        module = importlib.import_module(new)
        self._own_specs[spec.name] = module.__spec__  # the import system sets the old name's on it
        return module

    def exec_module(self, module):
        own = self._own_specs.pop(module.__spec__.name, None)
        if own is not None:  # executed at its new home already: only its own spec back
            module.__spec__ = own


def _old_costmodel(name: str) -> types.ModuleType:
    """The cost model (perf) and its CLI helpers (tools) under one old name."""
    from .perf import costmodel
    from .tools import costmodel as cli

    module = types.ModuleType(name, costmodel.__doc__)
    module.__dict__.update({k: v for k, v in vars(costmodel).items() if not k.startswith("__")})
    module.__dict__.update({k: getattr(cli, k) for k in COSTMODEL_CLI})
    return module


def install() -> None:
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
