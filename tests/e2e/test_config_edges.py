"""Issue 28's configuration edges: a key no schema has, settings that would fail later or
train on nothing, a refused run that leaves the run dir as it was, a read-only run dir."""


import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minddp.train.config import register
from tests.conftest import ROOT, SMALL
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
    if os.geteuid() == 0:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"minddp: configuration error: the run dir {tmp_path / where} " in p.stderr
    assert "not writable: choose another with MINDDP_RUN_DIR=<dir>" in p.stderr
