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


def test_the_engine_stays_small_enough_to_read():
    """ddp.py <= 400 lines, its class <= 300, no function in minddp/ over 60 lines, trainer.py
    <= 350, and the tools smaller than the engine and its seams together."""
    engine = ROOT / "minddp" / "ddp.py"
    assert len(engine.read_text().splitlines()) <= 400
    tree = ast.parse(engine.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DistributedDataParallel")
    assert cls.end_lineno - cls.lineno + 1 <= 300
    for path in sorted((ROOT / "minddp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 60, f"{path.relative_to(ROOT)}:{node.name}"
    lines = lambda paths: sum(len(p.read_text().splitlines()) for p in paths)  # noqa: E731
    assert lines([ROOT / "minddp" / "train" / "trainer.py"]) <= 350
    assert lines((ROOT / "minddp" / "tools").glob("*.py")) < lines((ROOT / "minddp").glob("*.py"))


def test_no_tracker_words_in_what_a_user_sees():
    import re

    paths = [*(ROOT / "minddp").rglob("*.py"), *(ROOT / "docs").glob("*.md"),
             *(ROOT / "scripts").glob("*.py"), ROOT / "README.md", ROOT / "Makefile"]
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in paths
            for m in re.finditer(r"(?i)\bissues? #?\d+", p.read_text())]
    assert not hits, hits
