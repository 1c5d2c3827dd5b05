"""Issue 28's configuration edges: a key no schema has, settings that would fail later or
train on nothing, a refused run that leaves the run dir as it was, a read-only run dir."""


import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minddp.train.config import register
from tests.conftest import ROOT, SMALL, as_nobody
from tests.launch import run_train

register()


@pytest.mark.slow
def test_a_refused_run_leaves_the_hydra_record_and_train_log_as_they_were(tmp_path):
    run = tmp_path / "run"
    run_train(run, *SMALL, "train.max_steps=2")
    before = {p.name: p.read_bytes() for p in [*(run / ".hydra").iterdir(), run / "train.log"]}
    assert set(before) == {"config.yaml", "hydra.yaml", "overrides.yaml", "train.log"}
    p = run_train(run, *SMALL, "train.max_steps=4", "train.resume=auto", "optim.lr=-1", check=False)
    assert p.returncode == 2 and "configuration error: optim.lr must be > 0" in p.stderr
    after = {p.name: p.read_bytes() for p in [*(run / ".hydra").iterdir(), run / "train.log"]}
    assert after == before
    fresh = tmp_path / "fresh"
    assert run_train(fresh, *SMALL, "+train.foo=1", check=False).returncode == 2
    assert not fresh.exists() or list(fresh.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_refused_run_leaves_no_empty_default_run_dir(tmp_path, nproc):
    """issue 56.12: Hydra makes outputs/<date>/<time>/ before the settings are checked."""
    (tmp_path / "keep").mkdir()  # the working directory's own folders stay
    p = run_train(None, *SMALL, "train.max_steps=-1", nproc=nproc, cwd=tmp_path, check=False)
    assert p.returncodes == [2] * nproc and "train.max_steps must be >= 1" in p.stderr, p.stderr[-2000:]
    assert sorted(q.name for q in tmp_path.iterdir()) == ["keep"], list(tmp_path.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["run", "run/sub"])
def test_a_read_only_run_dir_is_one_line(tmp_path, where, request):
    """As an unprivileged user (root writes anywhere): one line naming the folder, exit 2."""
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path.anchor + "tmp"))  # pytest's is private to its user
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    (tmp_path / "run").mkdir()
    os.chmod(tmp_path / "run", 0o555)
    os.chmod(tmp_path, 0o755)
    env = {**os.environ, "HOME": str(tmp_path), "MINDDP_RUN_DIR": str(tmp_path / where),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL]
    cmd = as_nobody(cmd)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"minddp: configuration error: the run dir {tmp_path / where} " in p.stderr
    assert "not writable: choose another with MINDDP_RUN_DIR=<dir>" in p.stderr


@pytest.mark.slow
def test_a_setting_one_rank_refuses_stops_every_rank_at_once(tmp_path):
    """Issue 45.11: a value that differs between ranks (here through the rank's own environment,
    as a node-local path or variable would) and that rank 0 alone refuses. Before, rank 0 waited
    30 s for its peers and rank 1 died ~35 s in with a DistNetworkError (exit 1); now the ranks
    agree on the verdict in one collective: the same line, naming the rank, exit 2 on both."""
    import time

    t0 = time.monotonic()
    p = run_train(tmp_path / "run", *SMALL, "train.timeout_s=${oc.env:RANK}", nproc=2, check=False,
                  timeout=90)
    took = time.monotonic() - t0
    assert p.returncodes == [2, 2], p.stderr[-3000:]
    line = "on rank 0 (1 of 2 ranks failed): train.timeout_s and train.init_timeout_s must be > 0"
    assert p.stderr.count(line) == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert took < 25, took
