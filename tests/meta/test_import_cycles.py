"""No two modules of the package import each other, directly or around a circle, at the top or
inside a function (an import hidden in a function is still a circle a reader has to follow)."""

import ast

from tests.conftest import ROOT

PKG = ROOT / "minddp"


def _modules() -> dict[str, object]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def import_graph(mods: dict) -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from . import x` counts as x, not the package)."""
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(x for x in (base, node.module) if x)
                subs = [f"{module}.{a.name}" for a in node.names]
                found |= {sub if sub in mods else module for sub in subs}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_package():
    assert not cycles(import_graph(_modules())), "modules that import each other: move the shared part down"


def test_the_check_sees_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
