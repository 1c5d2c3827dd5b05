"""Resume that never surprises (issue 28): a run dir resumed by name, corrupt newest
checkpoints of every kind falling back, a dangling checkpoints link, a bound on skipped
steps, checksums, file modes, Ctrl-C, and `minddp debug` on malformed dumps."""


import json
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from minddp.train import checkpoint
from minddp.train.checkpoint import integrity
from minddp.train.config import register
from tests.conftest import ROOT, SMALL, metrics
from tests.files import save_file
from tests.launch import env_for, run_train, wait_for_step

register()


# ------------------------------------------------------------- end to end (slow)
ARGS = [*SMALL, "train.max_steps=6", "train.ckpt_every=2"]
FILES = [*ARGS, "train.ckpt_format=file"]  # for the tests that damage a checkpoint file's bytes


@pytest.mark.slow
def test_a_stopped_run_resumes_by_the_printed_command_in_its_own_run_dir(tmp_path):
    out = tmp_path / "wd"
    out.mkdir()
    env = {k: v for k, v in env_for(tmp_path).items() if k != "MINDDP_RUN_DIR"}
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS, "train.stop_at_step=3"], cwd=out,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    command = (p.stdout + p.stderr).split("resume with:\n", 1)[1].splitlines()[0].strip()
    run_dir = next((out / "outputs").glob("*/*"))
    assert command.endswith(f"train.resume={run_dir}") and "stop_at_step" not in command, command
    argv = shlex.split(command)
    assert argv[0] == "python"
    time.sleep(1.1)  # a new process start second: a fresh run would get a new outputs/<date>/<time>
    p = subprocess.run([sys.executable, *argv[1:]], cwd=out, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/ckpt_00000003 at step 3" in p.stdout + p.stderr
    assert list((out / "outputs").glob("*/*")) == [run_dir]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_dangling_checkpoints_link_exits_2_and_keeps_the_metrics(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, *ARGS, "train.stop_at_step=2")
    (run_dir / "checkpoints").rename(tmp_path / "moved")
    (run_dir / "checkpoints").symlink_to(tmp_path / "unmounted")
    before = (run_dir / "metrics.jsonl").read_bytes()
    p = run_train(run_dir, *ARGS, "train.resume=auto", check=False, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"configuration error: {run_dir}/checkpoints is a symlink to {tmp_path}/unmounted" in p.stderr
    assert "Traceback" not in p.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before


@pytest.mark.slow
def test_every_step_skipped_stops_the_run_naming_the_lr(tmp_path):
    p = run_train(tmp_path / "run", *ARGS, "train.max_steps=40", "optim.lr=1e30", "train.max_skipped_steps=5",
                  check=False, timeout=120)
    assert p.returncode == 3, (p.returncode, p.stderr[-3000:])
    line = [x for x in p.stderr.splitlines() if "minddp: stopped:" in x]
    assert line and "5 steps in a row" in line[0] and "optim.lr=1e+30 is likely too high" in line[0], p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_nan_weights_in_the_checkpoint_stop_the_resume_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, *FILES, "train.stop_at_step=2")
    newest = checkpoint.latest(run_dir)
    state = torch.load(newest, weights_only=True)
    state.pop(integrity.KEY)
    state["model"] = {k: torch.full_like(v, float("nan")) for k, v in state["model"].items()}
    save_file(run_dir, 2, state)  # NaN, with valid checksums: as if saved so
    p = run_train(run_dir, *FILES, "train.resume=auto", "train.max_skipped_steps=3", check=False, timeout=120)
    assert p.returncode == 3, (p.returncode, p.stderr[-3000:])
    assert f"the weights are NaN/inf, from the checkpoint this run resumed from, {newest}" in p.stderr


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_saves_and_exits_130(tmp_path):
    run_dir = tmp_path / "run"
    job = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *ARGS, "train.max_steps=100000",
                            "train.ckpt_every=0"], cwd=ROOT, env=env_for(run_dir), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 3, 120)
        job.send_signal(signal.SIGINT)
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, out[-3000:]
    step = int(re.search(r"stopping after step (\d+) \(a stop signal\)", out).group(1))
    assert checkpoint.latest(run_dir).name == f"ckpt_{step:08d}" and "Traceback" not in out
    assert f"train.resume={run_dir}" in out


@pytest.mark.slow
def test_a_torn_checkpoint_and_a_flipped_bit_resume_from_the_previous_one(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, *FILES, "train.stop_at_step=4")
    newest = checkpoint.latest(run_dir)
    newest.write_bytes(newest.read_bytes()[:15_000])
    p = run_train(run_dir, *FILES, "train.resume=auto", nproc=2, timeout=180)
    assert "ckpt_00000002.pt at step 2" in p.stdout + p.stderr, p.stderr[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((run_dir / "run.json").read_text())["data"]["fingerprint"] is None  # synthetic
