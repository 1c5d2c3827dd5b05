"""W&B never takes a run down (issue 45.4-45.6), through train.py, read back from W&B's own
offline files (tests/wandb_offline.py): no network with a key set, a wandb/ folder that cannot be
written, and a job killed with SIGKILL whose W&B lost its unwritten tail."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, SMALL, as_nobody, metrics
from tests.launch import wait_for_step
from tests.wandb_offline import read_run, runs_under

ARGS = [a for a in SMALL if not a.startswith("wandb.mode")]


def _env(run_dir, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no WANDB_MODE: auto decides
    return {**env, "OMP_NUM_THREADS": "1", "MINDDP_RUN_DIR": str(run_dir), "WANDB_SILENT": "true", **extra}


def _train(args, env, timeout=120) -> subprocess.CompletedProcess:
    """A fresh interpreter: wandb keeps process-wide settings that a forked rank would inherit."""
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
def test_auto_with_a_key_and_no_network_goes_offline_within_seconds(tmp_path):
    """An air-gapped cluster that exports WANDB_API_KEY everywhere: before, a 95 s stall, then
    CommError (exit 1). Now one line, offline, and the run takes what an offline one does."""
    env = _env(tmp_path / "run", HOME=str(tmp_path), WANDB_API_KEY="k" * 40,
               WANDB_BASE_URL="http://127.0.0.1:9")  # nothing listens on port 9
    t0 = time.monotonic()
    p = _train([*ARGS, "train.max_steps=2", "wandb.mode=auto"], env, timeout=80)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    said = [line for line in (p.stdout + p.stderr).splitlines() if "did not answer" in line]
    assert len(said) == 1 and "http://127.0.0.1:9" in said[0] and "logging offline" in said[0], p.stdout
    (w,) = runs_under(tmp_path / "run")
    assert [h["_step"] for h in w["history"]] == [1, 2]
    print(f"auto with a key and no network: {took:.1f} s for the whole 2-step run")
    assert took < 40, took


def _nobody_can_write(run: Path) -> Path:
    """A run dir whose wandb/ is read-only, for an unprivileged user (root writes anywhere)."""
    run.mkdir(parents=True)
    (run / "wandb").mkdir()
    for folder in (run.parent, run):
        os.chmod(folder, 0o777)
    os.chmod(run / "wandb", 0o555)
    return run / "wandb"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["a file in its place", "read-only"])
def test_a_wandb_folder_that_cannot_be_written_is_one_warning_and_the_run_goes_on(tmp_path, how, request):
    """Before: exit 1 (NotADirectoryError / PermissionError out of wandb.init)."""
    if how == "read-only":
        tmp_path = Path(tempfile.mkdtemp(dir=tmp_path.anchor + "tmp"))  # pytest's is private to root
        request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
        os.chmod(tmp_path, 0o755)
        run = tmp_path / "run"
        where = _nobody_can_write(run)
    else:
        run = tmp_path / "run"
        run.mkdir()
        where = run / "wandb"
        where.write_text("not a folder")
    cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, "train.max_steps=3", "train.ckpt_every=2",
           "wandb.mode=offline"]
    if how == "read-only":
        cmd = as_nobody(cmd)
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(run, HOME=str(tmp_path)), cwd=tmp_path,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    warned = [line for line in (p.stdout + p.stderr).splitlines() if "W&B: cannot log to" in line]
    assert len(warned) == 1 and str(where) in warned[0] and "training goes on without W&B" in warned[0]
    assert "Traceback" not in p.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert sorted(f.name for f in (run / "checkpoints").glob("ckpt_*")) == ["ckpt_00000002", "ckpt_00000003"]


def _wandb_view(parts: list[dict]) -> list[dict]:
    """The history W&B shows after sync: each part's rows, a rewound part cutting the earlier
    ones after its branch step."""
    seen = []
    for w in parts:
        if w.get("branch") is not None:
            seen = [h for h in seen if h["_step"] <= w["branch"][1]]
        seen += w["history"]
    return seen


@pytest.mark.slow
def test_after_a_kill_9_the_resume_logs_again_what_wandb_never_wrote(tmp_path):
    """The job (trainer and W&B's service, as the OOM killer or a node failure take a job) is
    killed inside step 10, checkpoint 8 on disk, rows 1..9 in metrics.jsonl; W&B's file has
    lost its unwritten tail. Before, the resume rewound W&B to step 8 of records never written
    (steps missing for good); now W&B's history after the resume equals metrics.jsonl."""
    run = tmp_path / "run"
    args = [*ARGS, "train.max_steps=12", "train.ckpt_every=4", "train.eval_every=0", "wandb.mode=offline",
            "train.fault_sleep_step=10"]
    job = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, "train.fault_sleep_s=120"],
                           env=_env(run), cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        wait_for_step(run, 9, timeout=120)
        time.sleep(0.5)  # inside step 10's sleep
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    assert (run / "checkpoints" / "ckpt_00000008").exists()
    (killed,) = [read_run(f) for f in run.rglob("offline-run-*/run-*.wandb")]
    p = _train([*args, "train.fault_sleep_s=0", "train.resume=auto"], _env(run))
    assert p.returncode == 0, p.stderr[-3000:]
    parts = runs_under(run)
    assert len(parts) == 2
    parts[0] = killed  # the killed part as it was left (no exit record to wait for)
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    view = _wandb_view(parts)
    print(f"W&B had {len(killed['history'])} of the killed part's 9 rows; the resume rewound to "
          f"{parts[1]['branch']}")
    assert [h["_step"] for h in view] == [r["step"] for r in rows]
    for h, r in zip(view, rows):
        assert h["loss"] == pytest.approx(r["loss"], abs=1e-6), h["_step"]
