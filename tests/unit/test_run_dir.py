"""Issue 44: the run directory decided once (the resolver behind hydra.run.dir), checked once
(a Hydra callback, before Hydra makes it), and one live job per run dir (issue 45.1: the
lock's own rules here; two real jobs in tests/e2e/test_resume_lock.py)."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from minddp.train.config import register
from minddp.train.io import lock
from minddp.train.io.run_dir import CheckRunDir
from tests.conftest import ROOT

register()


def test_one_function_decides_the_run_dir():
    """Only the resolver calls default_run_dir, and the launcher above torchrun (make train,
    slurm/), which exports what it decided as MINDDP_RUN_DIR: no reader predicts the run dir
    again (train.py did, from argv; the launcher had a rule of its own), and conf/ routes both
    Hydra folders through it."""
    callers = [f"{p.relative_to(ROOT)}" for p in [ROOT / "train.py", *(ROOT / "minddp").rglob("*.py")]
               for line in p.read_text().splitlines()
               if re.search(r"default_run_dir\(", line) and "def default_run_dir" not in line]
    assert callers == ["minddp/train/launch.py"]
    conf = (ROOT / "conf" / "config.yaml").read_text()
    assert conf.count("${minddp.run_dir:") == 2  # hydra.run.dir and hydra.sweep.dir


def test_the_launcher_continues_the_run_dir_train_resume_names(tmp_path, monkeypatch):
    """make train ARGS=train.resume=<run dir>: the launcher's run dir is that one (it was a new
    dated folder, which the resume then refused as another run dir)."""
    from minddp.train.config import default_run_dir
    from minddp.train.launch import resume_of

    (tmp_path / "checkpoints").mkdir()
    monkeypatch.delenv("MINDDP_RUN_DIR", raising=False)
    argv = ["--nproc_per_node=2", "train.py", "train.max_steps=9", f"train.resume={tmp_path}"]
    assert resume_of(argv) == str(tmp_path) and resume_of(argv[:3]) is None
    assert default_run_dir(resume=resume_of(argv)) == str(tmp_path)


def test_the_run_dir_check_is_a_hydra_callback_that_exits_2_in_one_line(tmp_path, capsys):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    assert cfg.hydra.callbacks.check_run_dir._target_ == "minddp.train.io.run_dir.CheckRunDir"
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as e:
        CheckRunDir().on_run_start(compose_with(cfg, tmp_path / "a_file" / "run"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "minddp: configuration error: the run dir" in err, err
    CheckRunDir().on_run_start(compose_with(cfg, tmp_path / "fine"))  # writable: nothing happens


def compose_with(cfg, run_dir: Path):
    cfg = cfg.copy()
    cfg.hydra.run.dir = str(run_dir)
    return cfg


def test_the_lock_names_its_holder_and_a_second_holder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock.hold(tmp_path)
    lock.hold(tmp_path)  # the holding process again: no-op
    assert "Slurm job 4242" in (tmp_path / lock.NAME).read_text()
    monkeypatch.setattr(lock, "_held", {})  # as another process would see it: the flock is taken
    holder = r"in use by another live job \(host .*, pid \d+, Slurm job 4242\)"
    with pytest.raises(lock.RunDirInUse, match=holder):
        lock.hold(tmp_path)
