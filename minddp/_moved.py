"""Old import paths, kept for one release (0.4.0 moved the modules into folders; since 0.6.0 the
model left the trainer; README "What moved"): `import minddp.ddp` or `from minddp.zero import
ShardedOptimizer` is the module at its new home (the same module object, so patching one patches
the other), with a DeprecationWarning. A module whose names went to several homes (a tuple in
MOVED) is one new module holding them all, the first home's winning. A package that took an old
module's name (`minddp.optim`, `minddp.train.checkpoint`, `.data`, `.resume`) re-exports what the
module held instead.
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
    "gradnorm": "parallel.gradnorm", "collectives": "comm.collectives",
    # 0.3's minddp.costmodel also held its command line's helpers, now minddp.tools.costmodel's
    "costmodel": ("perf.costmodel", "tools.costmodel"),
    # the trainer's files, grouped by what a reader looks for (minddp/train/__init__.py)
    "train.agree": "train.safety.together", "train.signals": "train.safety.signals",
    "train.guard": "train.safety.guard", "train.faults": "train.safety.faults",
    "train.consistency": "train.safety.consistency", "train.resume_check": "train.resume.check",
    "train.state": "train.checkpoint.state", "train.tokens": "train.data.tokens",
    "train.integrity": ("train.checkpoint.integrity", "train.data.fingerprint"),
    "train.atomic": "io.atomic", "train.safe_pickle": "io.safe_pickle",
    "train.tracking": "train.metrics.tracking", "train.identity": "train.metrics.identity",
    "train.summary": "train.metrics.summary", "train.straggler": "train.metrics.straggler",
    "train.steptrace": "train.metrics.steptrace", "train.flops": "train.metrics.flops",
    "train.flight_recorder": "train.metrics.flight_recorder",
    # the model apart from its training; text -> token files and text from a run: the tools'
    "train.model": "model.gpt", "train.hf_gpt2": "model.hf_gpt2",
    "train.generate": "tools.sample", "train.data.prepare": "tools.prepare",
    # files written and read safely, for every layer
    "train.io.atomic": "io.atomic", "train.io.safe_pickle": "io.safe_pickle",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `minddp.<old>` and loads it as the module at its new home."""

    def __init__(self):
        self._own_specs: dict = {}  # old name -> the module's own spec, until exec_module

    def find_spec(self, fullname, path=None, target=None):
        root, _, old = fullname.partition(".")
        if root != "minddp" or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        homes = new_homes(spec.name.partition(".")[2])
        warnings.warn(f"{spec.name} moved to {' and '.join(homes)}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        if len(homes) > 1:
            return _merged(spec.name, homes)
        module = importlib.import_module(homes[0])
        self._own_specs[spec.name] = module.__spec__  # the import system sets the old name's on it
        return module

    def exec_module(self, module):
        own = self._own_specs.pop(module.__spec__.name, None)
        if own is not None:  # executed at its new home already: only its own spec back
            module.__spec__ = own


def new_homes(old: str) -> list[str]:
    """The absolute names of the modules an old one (`ddp`, `train.tokens`) went to."""
    new = MOVED[old]
    return [f"minddp.{n}" for n in ((new,) if isinstance(new, str) else new)]


def _merged(name: str, homes: list[str]) -> types.ModuleType:
    """One module under the old name holding the public names of each home (the first wins)."""
    modules = [importlib.import_module(h) for h in homes]
    merged = types.ModuleType(name, modules[0].__doc__)
    for m in reversed(modules[1:]):
        merged.__dict__.update({k: v for k, v in vars(m).items() if not k.startswith("_")})
    merged.__dict__.update({k: v for k, v in vars(modules[0]).items() if not k.startswith("__")})
    return merged


def install() -> None:
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
