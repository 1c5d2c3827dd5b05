"""The shell commands the docs print (README.md's ```bash blocks), and what a Slurm batch job sees,
for running the scripts in slurm/ without a cluster: the variables sbatch sets, and srun and
scontrol stand-ins (tests/slurm/fake/) for which every node is this machine."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.launch import ROOT

FAKE_SLURM = ROOT / "tests" / "slurm" / "fake"
SCRIPTS = sorted([*(ROOT / "slurm").glob("*.sh"), *(ROOT / "slurm").glob("*.sbatch")])
# what the scripts read from the environment: a test's own environment never leaks into a job
SCRIPT_VARS = ("MINDDP_RUN_DIR", "MINDDP_DRY_RUN", "NPROC_PER_NODE", "SWEEP_KEY", "SWEEP_VALUES", "HEAD",
               "NNODES", "JOB_ID", "PORT", "RDZV_PORT", "MAX_RESTARTS")


@dataclass
class Command:
    line: str  # as printed, without its comment
    env: dict  # its leading VAR=value assignments
    prog: str
    args: list


def doc_commands(path: Path = ROOT / "README.md") -> list[Command]:
    """Every command line of a markdown file's ```bash blocks."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.splitlines():
            words, env = shlex.split(line, comments=True), {}
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                key, value = words.pop(0).split("=", 1)
                env[key] = value
            if words:
                found.append(Command(line.split(" #", 1)[0].strip(), env, words[0], words[1:]))
    return found


def sbatch_options(script: Path, sbatch_args=()) -> dict:
    """The job's options: the script's #SBATCH lines, then the command line's (which win)."""
    opts = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.M))
    opts.update(a[2:].split("=", 1) for a in sbatch_args if a.startswith("--") and "=" in a)
    return opts


def array_tasks(opts: dict) -> list[int | None]:
    """--array=0-3 or 0,2: the task ids; no array: [None]."""
    if "array" not in opts:
        return [None]
    tasks = []
    for part in opts["array"].split("%")[0].split(","):
        first, _, last = part.partition("-")
        tasks += range(int(first), int(last or first) + 1)
    return tasks


def slurm_job_env(opts: dict, job_id: int = 4242, task: int | None = None) -> dict:
    """What sbatch gives a batch script with these options: the job's id, nodes (n1, n2, ...),
    submit dir (this checkout), CPUs and GPUs per node, its array task; srun and scontrol the
    stand-ins."""
    nodes = int(opts.get("nodes", 1))
    env = {"SLURM_JOB_ID": str(job_id), "SLURM_NNODES": str(nodes), "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_JOB_NODELIST": f"n[1-{nodes}]" if nodes > 1 else "n1",
           "SLURM_CPUS_PER_TASK": opts.get("cpus-per-task", "1"),
           "PATH": f"{FAKE_SLURM}:{os.environ['PATH']}"}
    gpus = re.search(r"gpu:(\d+)", opts.get("gres", ""))
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = gpus.group(1)
    if task is not None:
        env.update(SLURM_ARRAY_JOB_ID=str(job_id), SLURM_ARRAY_TASK_ID=str(task))
    return env


def run_script(script: Path, args=(), env: dict | None = None, dry: bool = False,
               timeout: float = 60) -> subprocess.CompletedProcess:
    """`bash SCRIPT ARGS` outside any Slurm job (none of Slurm's or the scripts' variables from
    this process), with `env` added; `dry`: MINDDP_DRY_RUN=1."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in SCRIPT_VARS}
    base = {**base, "MINDDP_PYTHON": sys.executable, **(env or {})}
    if dry:
        base["MINDDP_DRY_RUN"] = "1"
    return subprocess.run(["bash", str(script), *args], env=base, capture_output=True, text=True,
                          timeout=timeout)


def dry_run_line(p: subprocess.CompletedProcess) -> list[str]:
    """The command a dry run printed (its one line on stdout), as words."""
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 1, (p.returncode, p.stdout, p.stderr)
    return shlex.split(lines[0])
