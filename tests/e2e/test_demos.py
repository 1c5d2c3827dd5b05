"""Every textbook demo runs on 2 and 4 gloo ranks and its built-in checks pass."""


import subprocess
import sys

import pytest

from minddp.demos import DEMOS, MODULES
from tests import launch
from tests.conftest import BIN, ROOT


def _demo(rank, world_size, name):
    """The demo's own result and what it printed (rank 0 prints the tables)."""
    import contextlib
    import importlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = importlib.import_module(f"minddp.demos.{MODULES[name]}").run()
    return result, out.getvalue()


# what rank 0's table shows, per demo: the closed forms the demo asserts, as a reader sees them
def _shows(name, n) -> list[str]:
    total = n * (n + 1) // 2
    return {"spmd": [f"expect n(n-1)/2 = {n * (n - 1) // 2}", f"after={float(n * (n - 1) // 2)}"],
            "collectives": ["all_reduce=[" + ", ".join(f"{n * i + n * (n - 1) / 2}" for i in range(n)) + "]"],
            "manual_all_reduce": ["reduce_scatter + all_gather == all_reduce"],
            "hierarchical": [f"result {float(total)}"],
            "minimal_ddp": ["same parameters"]}.get(name, [])


# 4 ranks wherever it adds something (odd node counts, uneven splits, rings longer than 2);
# the async timing demo is about one overlap, and the deadlock one about one missing partner
# (its seconds are a timeout's): both shown on 2
CASES = [(name, 2) for name in sorted(DEMOS)] + [(name, 4) for name in sorted(DEMOS)
                                                 if name not in ("async", "deadlock")]


@pytest.mark.parametrize("name,world_size", CASES)
def test_demo(name, world_size):
    results = launch.ranks(_demo, world_size, name, timeout=90)
    out = results[0][1]
    for r in range(world_size):  # every table has every rank's row, gathered to rank 0
        assert out.count(f"  rank {r}: ") == out.count("  rank 0: ") >= 1, out
    for text in _shows(name, world_size):
        assert text in out, (text, out)
    if name == "async":  # the overlap it exists to show: each rank but the late last one
        # finished its matmul while its all-reduce still waited for the last rank
        assert [res["computed_while_pending"] for res, _ in results[:-1]] == [True] * (world_size - 1)
        assert "waited for rank 1: True" in out


def _demo_under_meta_default(rank, world_size, name):
    """The demo with torch's default device set to `meta` (the CPU stand-in for CUDA here): any
    tensor or module a demo, or torch code it calls (DistributedSampler's randperm), makes without
    naming its device lands on meta and the gloo collective or the check fails."""
    import importlib

    import torch

    with torch.device("meta"):
        importlib.import_module(f"minddp.demos.{MODULES[name]}").run()


@pytest.mark.parametrize("name", sorted(DEMOS))
def test_demo_names_its_device(name):
    launch.ranks(_demo_under_meta_default, 2, name, timeout=90)


@pytest.mark.slow
def test_cli_under_torchrun_and_help():
    p = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=4", "-m", "minddp.demos",
                        "collectives"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[collectives] all checks passed on 4 ranks" in p.stdout
    assert "reduce_scatter=6.0" in p.stdout and "reduce_scatter=18.0" in p.stdout
    h = subprocess.run([sys.executable, "-m", "minddp.demos", "--help"], capture_output=True, text=True)
    for name in DEMOS:
        assert name in h.stdout


@pytest.mark.slow
def test_wheel_carries_every_subpackage(tmp_path):
    """A non-editable install has minddp.demos too (package discovery, not a fixed list). Built
    from a copy: setuptools leaves build/ in the tree it builds (issue 56.10: `make test` left it
    in the checkout, where a stale build/lib can carry deleted modules into a later wheel)."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".*_cache", "outputs", "multirun", "wandb",
        "wheelhouse", "gpu_check", "data"))
    had_build = (ROOT / "build").exists()
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (ROOT / "build").exists() == had_build, "the wheel's build left build/ in the checkout"
    import zipfile

    names = zipfile.ZipFile(next(tmp_path.glob("minddp-*.whl"))).namelist()
    for module in MODULES.values():
        assert f"minddp/demos/{module}.py" in names
    assert "minddp/engine/ddp.py" in names
