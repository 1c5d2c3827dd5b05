"""The scripts in slurm/ without a cluster: each parses (bash -n); outside a Slurm job it says so in
one line (exit 2); MINDDP_DRY_RUN=1 prints the one command it would run and starts nothing; and
each runs for real with the environment Slurm gives a job, one node, two processes (srun and
scontrol stand-ins: tests/slurm/fake/). tests/e2e/test_launch.py submits them to a real Slurm."""

import json
import subprocess
import uuid

import pytest

from tests.commands import FAKE_SLURM, SCRIPTS, dry_run_line, run_script, sbatch_options, slurm_job_env
from tests.conftest import ROOT, SMALL, metrics
from tests.launch import free_port

pytestmark = pytest.mark.slow

SBATCH = [s for s in SCRIPTS if s.suffix == ".sbatch"]
MANUAL = ROOT / "slurm" / "multinode_manual.sh"
SHELL = [*SCRIPTS, ROOT / "tests" / "slurm" / "cluster.sh", *sorted(FAKE_SLURM.iterdir())]
ARGS = [*SMALL, "train.max_steps=3"]


def test_the_scripts_are_found():
    assert {s.name for s in SCRIPTS} == {"common.sh", "multinode_manual.sh", "single_node.sbatch",
                                         "multinode.sbatch", "sweep.sbatch"}


@pytest.mark.parametrize("script", SHELL, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_parses(script):
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr


def one_line(p):
    assert p.stdout == "" and len(p.stderr.splitlines()) == 1, (p.stdout, p.stderr)
    return p.stderr


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_outside_a_slurm_job_a_batch_script_says_so_in_one_line(script):
    env = {"SWEEP_KEY": "nproc", "SWEEP_VALUES": "1 2"}
    p = run_script(script, ["train.max_steps=5"], env)
    assert p.returncode == 2, p.stderr
    assert "SLURM_JOB_ID is not set" in one_line(p) and f"sbatch {script}" in p.stderr
    assert "unbound variable" not in p.stderr


def test_the_manual_script_without_head_says_so_in_one_line():
    p = run_script(MANUAL, ["train.max_steps=5"])
    assert p.returncode == 2 and "set HEAD to the address of the first node" in one_line(p)


def test_a_sweep_without_its_key_or_a_value_for_its_task_says_so_in_one_line():
    script = ROOT / "slurm" / "sweep.sbatch"
    job = slurm_job_env(sbatch_options(script), task=2)
    p = run_script(script, [], {**job, "SWEEP_VALUES": "1 2"})
    assert p.returncode == 2 and "set SWEEP_KEY" in one_line(p)
    p = run_script(script, [], {**job, "SWEEP_KEY": "ddp.bucket_cap_mb", "SWEEP_VALUES": "1 2"})
    assert p.returncode == 2 and "array task 2 has no value" in one_line(p) and "--array=0-1" in p.stderr


def launcher(words):
    """The dry-run line from the Python that runs minddp.train.launch: its torchrun arguments."""
    at = words.index("minddp.train.launch")
    return words[:at - 2], words[at + 1:]


def test_dry_runs_in_a_job_print_the_launch_line_and_start_nothing(tmp_path):
    over = ["train.max_steps=7", "model.name=it's mine"]
    env = {"NPROC_PER_NODE": "2", "MINDDP_RUN_DIR": str(tmp_path / "run")}
    single = ROOT / "slurm" / "single_node.sbatch"
    before, torchrun = launcher(dry_run_line(run_script(single, over, {**slurm_job_env(
        sbatch_options(single)), **env}, dry=True)))
    assert before == [f"MINDDP_RUN_DIR={tmp_path / 'run'}", "OMP_NUM_THREADS=1",
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
    assert torchrun == ["--standalone", "--nproc_per_node=2", "train.py", "train.resume=auto", *over]

    multi = ROOT / "slurm" / "multinode.sbatch"
    job = slurm_job_env(sbatch_options(multi, ["--nodes=4"]), job_id=277)
    p = run_script(multi, over, {**job, **env, "NPROC_PER_NODE": "8"}, dry=True)
    before, torchrun = launcher(dry_run_line(p))
    assert before[3:5] == ["srun", "--ntasks-per-node=1"]
    assert torchrun == ["--nnodes=4", "--nproc_per_node=8", "--rdzv_backend=c10d",
                        "--rdzv_endpoint=127.0.0.1:29777", "--rdzv_id=277", "--max-restarts=0", "train.py",
                        "train.resume=auto", *over]
    assert "4 nodes x 8, rendezvous at 127.0.0.1:29777" in p.stderr

    sweep = ROOT / "slurm" / "sweep.sbatch"
    job = slurm_job_env(sbatch_options(sweep, ["--nodes=2"]), job_id=55, task=1)
    p = run_script(sweep, over, {**job, "SWEEP_KEY": "layout", "SWEEP_VALUES": "1x1 2x2"}, dry=True)
    before, torchrun = launcher(dry_run_line(p))
    assert before[0] == "MINDDP_RUN_DIR=outputs/sweep-55/layout=2x2"
    assert before[3:] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=n1,n2",
                          "--kill-on-bad-exit=1"]
    assert torchrun[:2] == ["--nnodes=2", "--nproc_per_node=2"]
    assert torchrun[-3:] == ["wandb.group=sweep-55", *over]
    assert not (tmp_path / "run").exists()


def test_dry_runs_outside_a_job_show_what_slurm_decides_as_its_variables():
    for script in SBATCH:
        p = run_script(script, ["train.max_steps=7"], {"SWEEP_KEY": "nodes", "SWEEP_VALUES": "2"}, dry=True)
        line = " ".join(dry_run_line(p))
        assert "dry run outside a Slurm job" in p.stderr, p.stderr
        assert "$SLURM_" in line and "@" not in line, line
        if script.name != "single_node.sbatch":
            assert "--rdzv_endpoint=$HEAD_ADDR:$((29500+SLURM_JOB_ID%1000))" in line, line
    words = dry_run_line(run_script(MANUAL, ["train.max_steps=7"], {"HEAD": "10.0.0.1", "JOB_ID": "exp1"},
                                    dry=True))
    assert launcher(words)[1] == ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                  "--rdzv_endpoint=10.0.0.1:29500", "--rdzv_id=exp1", "train.py",
                                  "train.max_steps=7"]


def test_a_dry_run_names_a_python_without_minddp():
    p = run_script(ROOT / "slurm" / "single_node.sbatch", [], {"MINDDP_PYTHON": "/bin/false"}, dry=True)
    assert p.returncode == 0 and "/bin/false lacks torch, hydra or minddp" in p.stderr


def _trained_with_two_processes(run_dir, p):
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    info = json.loads((run_dir / "run.json").read_text())
    assert (info["world_size"], info["nodes"], info["nproc_per_node"]) == (2, 1, 2), info
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]


@pytest.mark.parametrize("name", ["single_node.sbatch", "multinode.sbatch"])
def test_a_batch_script_trains_in_a_one_node_job_with_two_processes(tmp_path, name):
    script = ROOT / "slurm" / name
    job = slurm_job_env(sbatch_options(script, ["--nodes=1"]), job_id=free_port())
    run_dir = tmp_path / "run"
    p = run_script(script, ARGS, {**job, "NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port()),
                                  "MINDDP_RUN_DIR": str(run_dir), "WANDB_MODE": "disabled"}, timeout=240)
    _trained_with_two_processes(run_dir, p)


def test_the_manual_script_trains_on_one_node_with_two_processes(tmp_path):
    run_dir = tmp_path / "run"
    env = {"HEAD": "127.0.0.1", "NNODES": "1", "NPROC_PER_NODE": "2", "PORT": str(free_port()),
           "JOB_ID": uuid.uuid4().hex[:8], "MINDDP_RUN_DIR": str(run_dir), "WANDB_MODE": "disabled"}
    _trained_with_two_processes(run_dir, run_script(MANUAL, ARGS, env, timeout=240))


def test_a_large_allocation_names_its_first_nodes_without_failing_on_a_closed_pipe():
    """The node list is read whole: `scontrol show hostnames | head -n1` under pipefail ended a
    job with SIGPIPE (exit 141) whenever head left before scontrol's last line (seen on 4 nodes;
    certain on 20000, whose names overflow the pipe's buffer)."""
    sweep = ROOT / "slurm" / "sweep.sbatch"
    job = slurm_job_env(sbatch_options(sweep, ["--nodes=20000"]), job_id=56, task=0)
    p = run_script(sweep, [], {**job, "SWEEP_KEY": "layout", "SWEEP_VALUES": "3x2",
                               "FAKE_SLURM_NODEADDR": "10.0.0.7"}, dry=True)
    before, torchrun = launcher(dry_run_line(p))
    assert "--nodelist=n1,n2,n3" in before, before
    assert "--rdzv_endpoint=10.0.0.7:29556" in torchrun, torchrun
