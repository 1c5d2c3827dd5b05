"""minddp/_compat.py is the only place that touches torch's private API: a torch release that
moves one of those calls breaks one file. This reads every other module of the package."""


import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "minddp"


# private names of *minddp's own or the standard library's* objects, reached from outside `self`
# (none of the engine's own: its seams call the reducer's and the wrapper's public methods)
ALLOWED = {("os", "_exit"),
           # torch DDP's ignore-list attributes on the user's module: the contract of
           # _set_params_and_buffers_to_ignore_for_model, which libraries set themselves
           ("module", "_ddp_params_and_buffers_to_ignore"), ("t", "_ddp_ignored")}


def _root(node: ast.AST) -> str:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else type(node).__name__


def private_uses(source: str) -> list[str]:
    found = ["'_c10d' in the text"] if "_c10d" in source else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"from {node.module} import {p}" for p in parts if p.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch") and "._" in a.name]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = _root(node.value)
            if root not in ("self", "cls") and (root, node.attr) not in ALLOWED:
                found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_only_compat_uses_private_torch_api():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        uses = private_uses(path.read_text())
        if uses:
            offenders[str(path.relative_to(PACKAGE.parent))] = uses
    assert not offenders, f"private torch API outside minddp/_compat.py (move it there): {offenders}"


def test_the_check_sees_each_kind_of_private_use():
    assert private_uses("import torch\nx = torch._C._foo()")
    assert private_uses("from torch._utils import _flatten_dense_tensors")
    assert private_uses("import torch.distributed as dist\ndist.distributed_c10d._get_default_store()")
    assert private_uses("def f(model):\n    return model._get_ddp_logging_data()")
    own = "import torch\nclass A:\n    def f(self):\n        return self._x + torch.ones(1)"
    assert not private_uses(own)
