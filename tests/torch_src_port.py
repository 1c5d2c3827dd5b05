"""torch's source-tree DDP tests with minddp's DistributedDataParallel in torch's place, ported to a
CPU-only machine; see tests/dist/test_torch_ddp_source_suite.py.

torch keeps a second set of DDP tests in its repository, not in the wheel:
test/distributed/test_c10d_common.py (class CommonDistributedDataParallelTest, the models) and
test/distributed/test_c10d_gloo.py (class DistributedDataParallelTest, which inherits it). They are
read from SOURCE_DIR (`MINDDP_TORCH_SRC`, default `.cache/torch_src/`, ignored by git: torch's code is
not committed here); docs/torch_ddp_tests.md says how to put them there. Nothing in torch is
patched: as tests/torch_ddp_port.py does for the wheel's tests, each file's text gets the DDP name
made minddp's (or left torch's, for the baseline), GPU placement made CPU placement, and is executed
as a new module: the common file as `test_c10d_common` (the gloo file imports it by that name).
"""

from __future__ import annotations

import os
import re
import sys
import types
from pathlib import Path

from tests import torch_ddp_port

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIR = Path(os.environ.get("MINDDP_TORCH_SRC", ROOT / ".cache" / "torch_src"))
# module name -> (path in pytorch/pytorch, the commit the copy was read at)
FILES = {
    "test_c10d_common": ("test/distributed/test_c10d_common.py", "00eb953ba8db83662cebaf661fd666361d5d83fb"),
    "test_c10d_gloo": ("test/distributed/test_c10d_gloo.py", "005a6a0b9ec22601279bf00a3f32e8696eee3b68"),
}
NAME = "tests._minddp_c10d_gloo"  # the gloo file, executed
CLASS = "DistributedDataParallelTest"

# beyond the wheel port's rules: what these two files write for "the rank's GPU"
PLACEMENT = [
    (r"\btorch\.accelerator\.set_device_index\(", "torch.cpu.set_device("),
    (r"(?<!def )\bgpus_for_rank\((self\.)?world_size\)", r"_cpu_gpus_for_rank(\1world_size)"),
    (r"\.to\(\s*self\.rank\s*\)", '.to("cpu")'),  # also split over lines
    (r"/cuda:\{self\.rank\}", "/cpu"),  # a ShardedTensor's placement, "rank:r/cuda:r"
]


def missing() -> list[str]:
    """The source files not in SOURCE_DIR (empty when the suite can run)."""
    return [path for path, _ in FILES.values() if not (SOURCE_DIR / Path(path).name).is_file()]


def fetch_hint() -> str:
    lines = [f"curl -fsSL https://raw.githubusercontent.com/pytorch/pytorch/{commit}/{path} "
             f"-o {SOURCE_DIR / Path(path).name}" for path, commit in FILES.values()]
    return f"torch's source-tree DDP tests are not in {SOURCE_DIR}; fetch them with\n" + "\n".join(lines)


def ported_source(module: str, ddp: str = "minddp") -> str:
    """The file's text with the DDP name made minddp's (ddp="minddp") or kept (ddp="torch"), and
    every GPU placement made the CPU's."""
    with open(SOURCE_DIR / Path(FILES[module][0]).name) as f:
        src = f.read()
    rules = (torch_ddp_port.DDP_NAME if ddp == "minddp" else []) + torch_ddp_port.PLACEMENT + PLACEMENT
    for pattern, repl in rules:
        src = re.sub(pattern, repl, src, flags=re.M)
    return torch_ddp_port._replace_calls(src)


def _cpu_gpus_for_rank(world_size) -> list[list[str]]:
    """gpus_for_rank's map (rank -> its GPU ids), one CPU "device" per rank."""
    return [["cpu"] for _ in range(int(world_size))]


def _execute(name: str, module_name: str, ddp: str) -> types.ModuleType:
    module = types.ModuleType(module_name)
    module.__file__ = str(SOURCE_DIR / Path(FILES[name][0]).name)
    module._cpu_gpus_for_rank = _cpu_gpus_for_rank
    sys.modules[module_name] = module
    try:
        # dont_inherit: this file's `from __future__ import annotations` would make the hooks'
        # annotations strings (the comm-hook checks compare them with dist.GradBucket)
        code = compile(ported_source(name, ddp), f"<{ddp} port of {FILES[name][0]}>", "exec",
                       dont_inherit=True)
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load(ddp: str = "minddp") -> types.ModuleType:
    """The ported gloo module (once per process; it imports the ported common module)."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    _execute("test_c10d_common", "test_c10d_common", ddp)
    return _execute("test_c10d_gloo", NAME, ddp)


def ddp_tests(module: types.ModuleType) -> list[str]:
    """Every test of DistributedDataParallelTest, its own and CommonDistributedDataParallelTest's."""
    cls = getattr(module, CLASS)
    return sorted(n for n in dir(cls) if n.startswith("test_") and callable(getattr(cls, n)))
