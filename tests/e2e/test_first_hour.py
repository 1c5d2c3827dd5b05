"""A newcomer's first hour from `git clone` (issue 43): CI runs where a clone lands, in a folder
named minddp; a typo is one line; a stop under torchrun ends in the resume command; tools never
rewrite the repository."""


import os
import subprocess

import pytest

from tests.launch import ROOT

pytestmark = pytest.mark.slow


def test_ci_runs_the_suite_in_a_folder_named_minddp(tmp_path):
    """.ci/run from a checkout named otherwise clones HEAD into .../minddp and runs `make test` there
    (a stand-in `make` on PATH reports where it ran)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "make").write_text('#!/bin/sh\necho "make $* in $(basename "$PWD") at $(git rev-parse HEAD)"\n')
    (fake / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run(["bash", str(ROOT / ".ci" / "run")], capture_output=True, text=True, env=env,
                       timeout=120)
    head = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    assert p.returncode == 0, p.stderr
    assert f"make test in minddp at {head}" in p.stdout, p.stdout + p.stderr


def test_prepares_default_output_folder_is_ignored_and_the_package_is_not():
    """`minddp prepare ... --out data/mine` (README) leaves git status clean; minddp/train/data/ is code."""
    p = subprocess.run(["git", "check-ignore", "--no-index", "data/mine/train.bin",
                        "minddp/train/data/tokens.py"], cwd=ROOT, capture_output=True, text=True)
    assert p.stdout.split() == ["data/mine/train.bin"], p.stdout
