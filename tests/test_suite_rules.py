"""The suite's own rules, so they stay true: shared helpers live in conftest.py or multiproc.py."""

import ast

import pytest

from tests.conftest import ROOT

MODULES = sorted((ROOT / "tests").glob("test_*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_test_module_imports_another(path):
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if isinstance(node, ast.ImportFrom) and node.module == "tests":
            names += [f"tests.{a.name}" for a in node.names]
        for name in names:
            assert not name.startswith("tests.test_"), \
                f"{path.name} imports {name}: move the helper to tests/conftest.py or tests/multiproc.py"
