"""The suite's own rules, so they stay true: shared helpers live in conftest.py, launch.py (how tests
start processes) or models.py (the engine tests' reference models and data)."""


import ast
import re

import pytest

from tests.conftest import ROOT

MODULES = sorted((ROOT / "tests").rglob("test_*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT / "tests")))
def test_no_test_module_imports_another(path):
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if isinstance(node, ast.ImportFrom) and node.module == "tests":
            names += [f"tests.{a.name}" for a in node.names]
        for name in names:
            assert ".test_" not in name and not name.startswith("tests.test_"), \
                f"{path.name} imports {name}: move it to tests/conftest.py, launch.py or models.py"


PKG = ROOT / "minddp"


# the layers, bottom up: a module imports only from its own layer or those below it
LAYERS = {"io": 0, "parallel": 0, "comm": 0, "model": 0, "engine": 1, "optim": 2, "perf": 3, "train": 4,
          "tools": 5, "demos": 5}


def engine_files() -> list:
    return sorted((PKG / "engine").glob("*.py"))


def optim_files() -> list:
    return sorted((PKG / "optim").glob("*.py"))


def test_the_engine_is_found_where_it_lives():
    names = {p.stem for p in engine_files()}
    assert {"ddp", "buckets", "reductions", "observer", "checks"} <= names, names
    assert {p.stem for p in optim_files()} >= {"replicated", "overlap", "zero"}


def test_the_engine_keeps_one_reducer_and_a_thin_wrapper():
    """Split by concern: the iteration's phases are the reducer's, what lives for one backward is
    the Iteration's; the wrapper only forwards, registers hooks and answers torch's API."""
    ddp = (PKG / "engine" / "ddp.py").read_text()
    for flag in ("finalize_queued", "next_bucket", "ready_order", "hooks_left"):
        assert flag not in ddp.split('"""', 2)[2], f"ddp.py holds the iteration's {flag}: the Iteration's"
    reducer = (PKG / "engine" / "reducer.py").read_text()
    for phase in ("def prepare_for_backward", "def autograd_hook", "def mark_variable_ready",
                  "def launch_ready_buckets", "def finalize_backward"):
        assert phase in reducer, phase
    iteration = (PKG / "engine" / "iteration.py").read_text()
    for state in ("self.used", "self.ready", "self.pending", "self.launched", "self.unused",
                  "self.next_bucket"):
        assert state in iteration, state


def _imported(path) -> set[str]:
    """Absolute names of the minddp modules `path` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(x for x in (base, node.module) if x)
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith("minddp")}


@pytest.mark.parametrize("path", sorted((PKG / "perf").glob("*.py")), ids=lambda p: p.name)
def test_perf_never_imports_the_trainer_or_the_tools(path):
    """Dependencies one way: perf reads the engine and the optimizers; the tools read perf."""
    bad = sorted(n for n in _imported(path) if n.startswith(("minddp.train", "minddp.tools")))
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", sorted(p for layer in LAYERS for p in (PKG / layer).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_dependencies_go_one_way(path):
    """io/parallel/comm/model -> engine -> optim -> perf -> train -> tools: never upwards."""
    own = LAYERS[path.relative_to(PKG).parts[0]]
    above = sorted(n for n in _imported(path) if LAYERS.get(n.split(".")[1] if "." in n else "", -1) > own)
    assert not above, f"{path.relative_to(PKG)} imports {above} from a layer above its own"


def test_the_package_root_holds_only_the_entry_points():
    """Everything else lives in its layer's folder (minddp/_moved.py answers the old paths)."""
    root = {p.name for p in PKG.glob("*.py")}
    assert root == {"__init__.py", "__main__.py", "_compat.py", "_moved.py", "errors.py"}, root


def test_the_import_check_resolves_relative_imports():
    assert "minddp.tools.cli" in _imported(PKG / "tools" / "bench.py")
    assert "minddp.perf.sweep" in _imported(PKG / "tools" / "bench.py")


def test_no_tracker_words_in_what_a_user_sees():
    import re

    paths = [*(ROOT / "minddp").rglob("*.py"), *(ROOT / "docs").glob("*.md"),
             *(ROOT / "scripts").glob("*.py"), ROOT / "README.md", ROOT / "Makefile"]
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in paths
            for m in re.finditer(r"(?i)\bissues? #?\d+", p.read_text())]
    assert not hits, hits


# what each layer of the suite may start: unit nothing, dist gloo ranks, e2e anything
STARTS = {"unit": r"\btests\.launch\b|\binit_process_group\b|\bsubprocess\b|\bPopen\b",
          "dist": r"\b(run_train|train_py|running_job|torchrun|command|script)\(|\bsubprocess\b|\bPopen\b"
                  r"|\bin_process_trainer\b"}


@pytest.mark.parametrize("path", [p for p in MODULES if p.parent.name in STARTS],
                         ids=lambda p: str(p.relative_to(ROOT / "tests")))
def test_each_layer_of_the_suite_starts_only_what_it_is_for(path):
    """tests/unit: no process group, no process; tests/dist: gloo ranks (launch.ranks), no
    train.py, torchrun or CLI (those are tests/e2e); tests/meta reads files."""
    text = path.read_text()
    found = sorted(set(m.group(0) for m in re.finditer(STARTS[path.parent.name], text)))
    assert not found, f"{path.relative_to(ROOT)} uses {found}: it belongs in a later layer"


def test_every_test_module_is_in_a_layer():
    layers = ("unit", "dist", "e2e", "meta")
    outside = [str(p.relative_to(ROOT)) for p in MODULES if p.parent.name not in layers]
    assert not outside, outside


def test_make_clean_and_the_leftovers_check_cover_a_wheels_build_folder():
    """issue 56.10: `make test` left build/ (a wheel built in the checkout); make clean kept it."""
    import subprocess

    from tests.conftest import DEFAULT_OUTPUTS

    p = subprocess.run(["make", "-n", "clean"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and re.search(r"^rm -rf .*\bbuild\b", p.stdout, re.M), p.stdout
    assert "build" in DEFAULT_OUTPUTS
