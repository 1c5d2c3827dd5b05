"""A newcomer's first hour from `git clone` (issue 43): CI runs where a clone lands, in a folder
named minddp; a typo is one line; a stop under torchrun ends in the resume command; tools never
rewrite the repository."""


import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import SMALL
from tests.launch import ROOT, env_for, free_port, torchrun, wait_for_step

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


@pytest.mark.parametrize("typo,fix", [
    ("train.max_stepz=5", "unknown key train.max_stepz (did you mean train.max_steps?)"),
    ("data.dir=/somewhere", "unknown key data.dir (it is a setting of data=tokens: add data=tokens)"),
    ("model=gtp", "Could not find 'model/gtp' (options: gpt, mlp)"),
    ("train.bf16=auto", "train.bf16: Value 'auto' is not a valid bool (type str) (give train.bf16=true, "
                        "false or null: null is the automatic choice, once spelled auto)"),
])
def test_a_typo_is_one_line_with_the_fix_and_exit_2(tmp_path, typo, fix):
    """Hydra's own advice (`+train.max_stepz=5`) only adds a key nothing reads: the first try gets the fix."""
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), typo], capture_output=True, text=True,
                       env=env_for(tmp_path / "run"), cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [f"[rank 0] minddp: configuration error: {fix}"], p.stderr
    assert p.stdout == "" and not (tmp_path / "run").exists()


def test_a_typo_under_torchrun_exits_2_on_every_rank(tmp_path):
    """No rank killed (-15) before it reports: each waits for the others, then exits 2."""
    p = subprocess.run(torchrun(2, ROOT / "train.py", "train.max_stepz=5"), capture_output=True, text=True,
                       env=env_for(tmp_path / "run"), cwd=tmp_path, timeout=120)
    out = p.stdout + p.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] minddp: configuration error: unknown key train.max_stepz (did you mean " \
               "train.max_steps?)" in out, out
    assert out.count("exitcode  : 2") == 2 and "-15" not in out, out


def test_help_cfg_and_sweeps_still_work(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, str(ROOT / "train.py"), *a], capture_output=True,  # noqa: E731
                                    text=True, env=env_for(tmp_path / "run"), cwd=tmp_path, timeout=120)
    assert "powered by Hydra" in run("--help").stdout
    job = run("--cfg", "job", "train.max_steps=7")
    assert job.returncode == 0 and "max_steps: 7" in job.stdout, job.stderr
    sweep = run("-m", *SMALL, "train.max_steps=1", "train.eval_every=0", "seed=1,2", "wandb.mode=disabled")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert len(list((tmp_path / "run").glob("*/metrics.jsonl"))) == 2
    typo = run("-m", "train.max_stepz=1,2")
    assert typo.returncode == 2 and typo.stderr.count("did you mean train.max_steps?") == 1, typo.stderr


def test_studies_never_rewrite_the_repository(tmp_path):
    """make timeline and make scaling write to outputs/; only make docs regenerates docs/."""
    dry = lambda target: subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True,  # noqa: E731
                                        text=True, timeout=60).stdout
    for target in ("timeline", "scaling"):
        assert "minddp" in dry(target) and "docs/" not in dry(target), dry(target)
    assert "--out docs/timeline" in dry("docs")
    assert "--out outputs/docs/scaling" in dry("docs") and "scaling.png docs/" in dry("docs")  # its report
    study = tmp_path / "study"
    for world in (1, 2):
        run = study / f"ws{world}-cap25"
        run.mkdir(parents=True)
        row = ('"step_time_s": 0.5, "tokens_per_s": 100.0, "comm/busy_s": 0.01, '
               '"comm/exposed_wait_s": 0.001, '
               '"comm/bytes": 4e6, "comm/collectives": 4')
        (run / "metrics.jsonl").write_text("".join(f'{{"step": {i}, {row}}}\n' for i in range(1, 7)))
    status = ["git", "status", "--porcelain", "--", "docs"]
    before = subprocess.check_output(status, cwd=ROOT, text=True)
    p = subprocess.run([sys.executable, "-m", "minddp", "scaling", "--reuse", str(study), "--worlds", "1,2",
                        "--caps", "25", "--warmup", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert (study / "scaling.md").exists() and subprocess.check_output(status, cwd=ROOT, text=True) == before


STOPPABLE = [*SMALL, "train.max_steps=400", "train.log_every=1"]


def _stopped(launcher: list[str], run_dir, sig) -> tuple[int, str]:
    job = subprocess.Popen([*launcher, str(ROOT / "train.py"), *STOPPABLE], cwd=ROOT, env=env_for(run_dir),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 3, 120)
        job.send_signal(sig)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    return job.returncode, out


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_where_minddp_launches_torchrun_a_stop_ends_in_the_resume_command(tmp_path, sig, code):
    """make train NPROC=2 and slurm/ run torchrun through minddp.train.launch: the README's exit codes,
    and the resume command is what a person reads last."""
    launch = [sys.executable, "-m", "minddp.train.launch", "--nproc_per_node=2", "--rdzv_backend=c10d",
              f"--rdzv_endpoint=127.0.0.1:{free_port()}"]
    rc, out = _stopped(launch, tmp_path / "run", sig)
    assert rc == code, out[-3000:]
    last = out.strip().splitlines()[-2:]
    assert last[0] == f"minddp: stopped by {sig.name}, checkpoint saved; resume with:", out[-3000:]
    assert last[1].strip().startswith("torchrun "), last
    assert last[1].endswith(f"train.resume={tmp_path / 'run'}"), last
    assert "SignalException" not in out
    # torchrun's report of failed workers (ChildFailedError, ~40 lines) came before it after a Ctrl-C
    assert "ChildFailedError" not in out and "Root Cause" not in out and "Traceback" not in out, out[-3000:]


def test_bare_torchrun_exits_1_on_sigterm_and_the_resume_command_is_in_train_log(tmp_path):
    """What the README says of a bare torchrun: its agent's own traceback and exit 1; the workers
    still checkpoint, and <run dir>/train.log keeps the resume command."""
    rc, out = _stopped(torchrun(2), tmp_path / "run", signal.SIGTERM)
    assert rc == 1 and "SignalException" in out, out[-3000:]
    log = (tmp_path / "run" / "train.log").read_text().splitlines()
    at = max(i for i, line in enumerate(log) if line.endswith("resume with:"))
    assert log[at + 1].strip().endswith(f"train.resume={tmp_path / 'run'}"), log[at:]
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt_*"))


def _shape(line: str, run_dir: str) -> str:
    """A log line with what changes between runs (run dir, numbers, timings, timestamps) made alike."""
    line = re.sub(r"^\[[\d\- :,]+\]\[minddp\]", "[minddp]", line)
    line = line.replace(run_dir, "RUN") if run_dir else line
    line = re.sub(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", "RUN", line)
    return re.sub(r"\d[\d,.:]*", "N", line)


def test_the_readmes_sample_output_is_what_make_train_prints(tmp_path):
    """Every line of README's sample log, in order, in a real `python train.py` log (numbers aside)."""
    readme = (ROOT / "README.md").read_text().split("## Running and launching")[0]
    sample = readme.split("```\n[minddp]", 1)[1].split("```", 1)[0]
    expected = [_shape(line, "") for line in ("[minddp]" + sample).splitlines() if line.strip()]
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "train.max_steps=3"], capture_output=True,
                       text=True, env=env_for(run, WANDB_MODE="offline"), cwd=ROOT, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    got = [_shape(line, str(run)) for line in (p.stdout + p.stderr).splitlines()]
    at = 0
    for line in expected:
        assert line in got[at:], f"README's\n  {line}\nnot in the run's log, in order:\n" + "\n".join(got)
        at = got.index(line, at) + 1
