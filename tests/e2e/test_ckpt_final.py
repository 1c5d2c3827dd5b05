"""train.ckpt_final=false: no checkpoint at max_steps but the ones ckpt_every makes; minddp
scaling's timing runs save nothing (issue 56.8: `--worlds 1,2 --mode weak` left ~1 GB of final
checkpoints, one per timing run, since ckpt_every=0 still saved at the end)."""

import subprocess

import pytest

from minddp.perf import study
from tests.conftest import SMALL
from tests.launch import run_train

RUN = [*SMALL, "train.eval_every=0"]


def _saved(run_dir) -> list[str]:
    """ckpt_2 for checkpoints/ckpt_00000002 (a folder) or ckpt_00000002.pt."""
    steps = (int(p.name.split("_")[1].split(".")[0]) for p in (run_dir / "checkpoints").glob("ckpt_*"))
    return [f"ckpt_{s}" for s in sorted(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("steps,every,final,saved", [
    (3, 0, "false", []),
    (3, 2, "false", ["ckpt_2"]),
    (4, 2, "false", ["ckpt_2", "ckpt_4"]),  # due at max_steps: saved (in the foreground)
    (3, 0, "true", ["ckpt_3"]),  # the default: a checkpoint at the end
])
def test_ckpt_final(tmp_path, steps, every, final, saved):
    run = tmp_path / "run"
    p = run_train(run, *RUN, f"train.max_steps={steps}", f"train.ckpt_every={every}",
                  f"train.ckpt_final={final}")
    assert _saved(run) == saved, p.stderr[-2000:]
    if final == "false":
        assert "none at max_steps unless ckpt_every is due (ckpt_final=false)" in p.stdout + p.stderr


def test_the_studys_timing_runs_save_nothing(tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(study, "run_job", lambda cmd, env, cwd: launched.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    study.run(tmp_path / "ws1", 1, 25.0, 4, "g", [])
    [cmd] = launched
    assert "train.ckpt_every=0" in cmd and "train.ckpt_final=false" in cmd, cmd
