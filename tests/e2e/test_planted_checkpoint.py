"""A crafted checkpoint folder runs no code, through every path that opens one (issue 56.1): a real
run's folder copied to `ckpt_99999999/`, its `.metadata` a pickle whose `__reduce__` creates a
marker file and its integrity.json recomputed (a CRC list anyone can write). Resume falls back
past it; `minddp export` and `minddp sample` of the run use the previous checkpoint, and of the
folder itself say in one line that it is corrupt (exit 2). The marker never appears."""

import pickle
import shutil

import pytest

from minddp.tools import export, sample
from tests.conftest import SMALL, main_exit
from tests.launch import run_train
from tests.planted import Payload, replant

ARGS = [*SMALL, "train.max_steps=6", "train.ckpt_every=2", "train.eval_every=0"]


@pytest.mark.slow
def test_a_planted_folder_runs_no_code_on_resume_export_or_sample(tmp_path, capsys):
    run = tmp_path / "run"
    run_train(run, *ARGS, "train.stop_at_step=4")
    bad = run / "checkpoints" / "ckpt_99999999"
    shutil.copytree(run / "checkpoints" / "ckpt_00000004", bad)
    marker = tmp_path / "payload-ran"
    replant(bad, pickle.dumps(Payload(marker)))

    code, err = main_exit(export.main, capsys, run, "--to", tmp_path / "hf", "--no-torch-file")
    assert code == 0 and "ckpt_99999999 is corrupt: DCP's .metadata was refused" in err, err
    code, err = main_exit(export.main, capsys, bad, "--to", tmp_path / "hf2")
    assert code == 2 and err.count("\n") == 1 and "refused to load builtins.exec" in err, err
    code, err = main_exit(sample.main, capsys, bad, "--tokens", "4")
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and "refused to load builtins.exec" in errors[0], err
    assert not marker.exists()

    p = run_train(run, *ARGS, "train.resume=auto")
    out = p.stdout + p.stderr
    assert "ckpt_99999999 is corrupt: DCP's .metadata was refused" in out, out[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'ckpt_00000004'}" in out, out[-3000:]
    assert not marker.exists()
