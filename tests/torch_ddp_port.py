"""torch's own DDP tests (the wheel's distributed_test.py) with minddp's DistributedDataParallel
in torch's place, ported to a CPU-only machine; see tests/dist/test_torch_ddp_suite.py.

Nothing in torch is patched: the file's source text is read, its DDP name is made minddp's,
placement on a GPU is made placement on the CPU, and the result is executed as a new module,
`tests._minddp_distributed_test`. Each rewrite below is a text substitution over the whole
file; only the tests the suite selects run, and for them the substitutions change where
tensors live, never what is computed or asserted.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import types

NAME = "tests._minddp_distributed_test"
ENV = {"BACKEND": "gloo", "WORLD_SIZE": "2"}  # read when the file is executed (decorators)
TIMEOUT_S = "120"  # torch's per-test limit (its default is 300), read when its harness is imported

# (pattern, replacement): the DDP name first, then GPU placement -> CPU
DDP_NAME = [
    (r"from torch\.nn\.parallel import DistributedDataParallel\b",
     "from minddp import DistributedDataParallel"),
    (r"\btorch\.nn\.parallel\.DistributedDataParallel\b", "DistributedDataParallel"),
    (r"(?<![\w.])nn\.parallel\.DistributedDataParallel\b", "DistributedDataParallel"),
]
PLACEMENT = [
    (r"^[ \t]*@skip_if_lt_x_gpu\(.*\)[ \t]*\n", ""),  # the only GPU need left is placement
    (r"^[ \t]*@skip_if_no_gpu[ \t]*\n", ""),
    (r"\btorch\.cuda\.(set_device|synchronize)\(", r"torch.cpu.\1("),
    (r"\btorch\.cuda\.current_device\(\)", 'torch.cpu.current_device()'),
    (r"\bdevice=(self\.)?rank\b", 'device="cpu"'),
    (r"\.to\((self\.)?rank\)", '.to("cpu")'),
    (r"\bdevice=[\"']cuda[\"']", 'device="cpu"'),
    (r"\binit_device_mesh\([\"']cuda[\"']", 'init_device_mesh("cpu"'),
    (r"^([ \t]*(?:device|device_id)) = (?:self\.)?rank$", r'\1 = "cpu"'),  # then .to(device)
    (r"\binit_multigpu_helper\(", "_cpu_rank_to_devices("),
    # a group of the ranks whose GPU ids (one GPU per rank: id == rank) it lists
    (r"new_group\(gpus\)", "new_group(list(range(world_size)))"),
]
# keyword arguments whose whole value (up to the next top-level , or )) becomes None
TO_NONE = ("device_ids=", "output_device=")


def _end_of_expr(src: str, i: int) -> int:
    """Index just past the expression that starts at src[i] (stops at a top-level , or ))."""
    depth = 0
    while i < len(src):
        c = src[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return i
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    return i


def _replace_calls(src: str) -> str:
    """`x.cuda(...)` -> `x.cpu()`; `torch.device("cuda...", ...)` -> `torch.device("cpu")`;
    `device_ids=...` / `output_device=...` -> `=None`."""
    out, i = [], 0
    keywords = "|".join(map(re.escape, TO_NONE))
    pattern = re.compile(r"\.cuda\(|\btorch\.device\((?=\s*f?[\"']cuda)|\b(?:%s)" % keywords)
    for m in pattern.finditer(src):
        if m.start() < i:
            continue
        out.append(src[i:m.start()])
        if m.group().endswith("("):
            end = _end_of_expr(src, m.end())  # the closing parenthesis
            out.append(".cpu()" if m.group() == ".cuda(" else 'torch.device("cpu")')
            i = end + 1
        else:
            out.append(m.group() + "None")
            i = _end_of_expr(src, m.end())
    out.append(src[i:])
    return "".join(out)


def ported_source() -> str:
    origin = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test").origin
    with open(origin) as f:
        src = f.read()
    for pattern, repl in DDP_NAME + PLACEMENT:
        src = re.sub(pattern, repl, src, flags=re.M)
    return _replace_calls(src)


def _cpu_rank_to_devices(world_size: int, backend: str) -> dict:
    """init_multigpu_helper's map (rank -> its devices), one CPU "device" per rank."""
    return {rank: ["cpu"] for rank in range(int(world_size))}


def load() -> types.ModuleType:
    """The ported module (executed once per process)."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    module = types.ModuleType(NAME)
    module.__file__ = __file__
    module._cpu_rank_to_devices = _cpu_rank_to_devices
    env = {**ENV, "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": TIMEOUT_S}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        sys.modules[NAME] = module
        # dont_inherit: this file's `from __future__ import annotations` would make the tests'
        # annotations strings (torch's comm-hook check compares them with dist.GradBucket)
        code = compile(ported_source(), "<minddp port of distributed_test.py>", "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[NAME]
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return module


def ddp_tests() -> set[str]:
    """The _DistTestBase tests that construct DistributedDataParallel, in their own body or in a
    `self._helper` they call (transitively): the population the suite selects from."""
    tree = ast.parse(ported_source())
    base = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "_DistTestBase")
    methods = {f.name: f for f in base.body if isinstance(f, ast.FunctionDef)}

    def constructs(f) -> bool:
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                   and n.func.id == "DistributedDataParallel" for n in ast.walk(f))

    def helpers(f) -> set[str]:
        return {n.attr for n in ast.walk(f) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr in methods}

    def reaches(name, seen) -> bool:
        seen.add(name)
        f = methods[name]
        return constructs(f) or any(reaches(h, seen) for h in helpers(f) - seen)

    return {name for name in methods if name.startswith("test_") and reaches(name, set())}
