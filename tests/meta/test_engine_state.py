"""The engine's objects list their state in one place: every attribute of an object defined in
minddp/engine/ is created in its class's `__init__` (or a base class's; `__setstate__` too, which
unpickling runs instead of `__init__`), or declared in the class body (dataclass fields, class
defaults): pylint's attribute-defined-outside-init, checked on the source with ast. That no
module reads another's `_private` attribute is tests/meta/test_private_torch.py's rule (every
module of the package)."""

import ast

import pytest

from tests.conftest import ROOT

ENGINE = sorted((ROOT / "minddp" / "engine").glob("*.py"))
DEFINING = {"__init__", "__setstate__"}


def _classes(paths) -> dict[str, ast.ClassDef]:
    found = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found[node.name] = node
    return found


def _self_targets(node: ast.AST) -> list[tuple[str, int]]:
    """(attribute, line) for every `self.X = ...`, `self.X: T = ...`, `self.X += ...` under node."""
    out = []
    for n in ast.walk(node):
        targets = (n.targets if isinstance(n, ast.Assign) else
                   [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for leaf in ast.walk(t):
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                        and leaf.value.id == "self" and isinstance(leaf.ctx, ast.Store)):
                    out.append((leaf.attr, leaf.lineno))
    return out


def _declared(cls: ast.ClassDef, classes: dict) -> set[str]:
    """What the class (and its engine bases) creates in its defining methods or its body."""
    names = set()
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if item.name in DEFINING:
                names |= {a for a, _ in _self_targets(item)}
            elif any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                names.add(item.name)  # a property's setter stores through it
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            names |= _declared(classes[base.id], classes)
    return names


def outside_init(paths) -> list[str]:
    classes = _classes(paths)
    found = []
    for cls in classes.values():
        declared = _declared(cls, classes)
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name not in DEFINING:
                found += [f"{cls.name}.{attr} (line {line}, in {item.name})"
                          for attr, line in _self_targets(item) if attr not in declared]
    return found


@pytest.mark.parametrize("path", ENGINE, ids=lambda p: p.name)
def test_every_engine_attribute_is_born_in_init(path):
    found = outside_init(ENGINE)  # (bases may live in another engine module)
    mine = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    here = [f for f in found if f.split(".")[0] in mine]
    assert not here, f"{path.name}: attributes created outside __init__ (create them there): {here}"


def test_the_check_sees_an_attribute_born_outside_init(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class A:\n    def __init__(self):\n        self.a = 1\n"
                   "    def go(self):\n        self.a, self.b = 2, 3\n        self.c += 1\n"
                   "class B(A):\n    x = 0\n    def go(self):\n"
                   "        self.a = self.x = 4\n        self.d = 5\n")
    assert outside_init([bad]) == ["A.b (line 5, in go)", "A.c (line 6, in go)", "B.d (line 11, in go)"]
