"""Every command README.md prints in its ```bash blocks can run, checked in a form that needs no
cluster and trains nothing: a make target by `make -n`; a `minddp <tool>` line by that tool's own
argparse; `python`/`torchrun train.py` by torchrun's parser and Hydra composing the overrides
(`python -c` compiles, `-m` finds its module, `pip install 'minddp[x]'` names an extra); a
script in slurm/ (or sbatch of one) by its dry run (MINDDP_DRY_RUN=1) with the environment sbatch
would give the job, for every array task, and the overrides its launch line passes on composed.
A command that no check here covers fails: add its check."""

import argparse
import re
import shlex
import subprocess
import sys

import pytest

from tests import commands
from tests.commands import SCRIPTS, Command, doc_commands, dry_run_line, run_script
from tests.conftest import ROOT, compose_config

COMMANDS = doc_commands(ROOT / "README.md")
SLOW = ("make", "sbatch", "slurm/")  # these start a process (make -n, bash)


class Accepted(Exception):
    """A tool's argparse took the arguments; the tool itself does not run."""


def check_tool(command, monkeypatch):
    from minddp.tools import main

    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)  # a bad argument: its usage line and SystemExit(2)
        raise Accepted

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the tools' entry sets sys.argv
    with pytest.raises(Accepted):
        main(command.args)


def first_of_each_sweep(overrides: list[str]) -> list[str]:
    """Hydra overrides with each sweep (`k=a,b`) at its first value: one job of the multirun."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [f"{o.get_key_element()}={next(o.sweep_string_iterator())}" if o.is_sweep_override()
            else o.input_line for o in OverridesParser.create().parse_overrides(overrides)]


def check_overrides(overrides: list[str]) -> None:
    """train.py's config composes with these overrides (a misspelled key or a wrong type fails)."""
    from minddp.train.config import register

    register()
    compose_config(*first_of_each_sweep([o for o in overrides if o != "-m"]))


def check_python(command, monkeypatch):
    """python -c CODE (it compiles), python -m MODULE (it exists), or python/torchrun train.py
    OVERRIDES (torchrun's parser takes its options; the overrides compose)."""
    import importlib.util

    args = command.args
    if command.prog == "python" and args[:1] == ["-c"]:
        compile(args[1], "<README>", "exec")
        return
    script = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
    if script is None:  # -m MODULE ...
        module = args[args.index("-m") + 1]
        found = importlib.util.find_spec(module.split(".")[0]) and importlib.util.find_spec(module)
        assert found, f"README: {command.line}: no module {module}"
        return
    assert args[script] == "train.py" and (ROOT / "train.py").is_file(), command.line
    if command.prog == "torchrun":
        from torch.distributed.run import get_args_parser

        get_args_parser().parse_args([*args[:script], "train.py"])
    else:
        assert args[:script] == [], command.line
    check_overrides(args[script + 1:])


def check_pip(command, monkeypatch):
    """pip install 'minddp[EXTRA]': the extra is pyproject.toml's."""
    import tomllib  # noqa: I001 - ruff's target version does not know it as stdlib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert command.args[0] == "install", command.line
    for requirement in command.args[1:]:
        m = re.fullmatch(r"minddp\[([\w,-]+)\]", requirement)
        ok = m and set(m.group(1).split(",")) <= set(extras)
        assert ok, f"README: {command.line}: pyproject.toml's extras are {sorted(extras)}"


def check_make(command, monkeypatch):
    assignments = dict(a.split("=", 1) for a in command.args[1:])
    p = subprocess.run(["make", "-n", *command.args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"README: {command.line}: make -n: {p.stderr[-2000:]}"
    for key in ("ARGS", "SWEEP"):  # the Hydra overrides the target passes on
        if key in assignments:
            check_overrides(shlex.split(assignments[key]))


def check_script(command, monkeypatch):
    """slurm/X.sh ARGS, or sbatch [OPTIONS] slurm/X.sbatch ARGS: the dry run of every task of
    the job, in the environment sbatch would give it."""
    at = next(i for i, a in enumerate([command.prog, *command.args]) if a.startswith("slurm/"))
    words = [command.prog, *command.args]
    script, options, overrides = ROOT / words[at], words[1:at], words[at + 1:]
    assert script in SCRIPTS, command.line
    jobs = [{}]
    if command.prog == "sbatch":
        opts = commands.sbatch_options(script, options)
        jobs = [commands.slurm_job_env(opts, task=task) for task in commands.array_tasks(opts)]
    for job in jobs:
        p = run_script(script, overrides, {**job, **command.env}, dry=True)
        assert p.returncode == 0, f"README: {command.line} ({job.get('SLURM_ARRAY_TASK_ID', '')}): {p.stderr}"
        line = dry_run_line(p)
        assert line[len(line) - len(overrides):] == overrides, line
        check_overrides(line[line.index("train.py") + 1:])


def check_source(command, monkeypatch):
    makefile = (ROOT / "Makefile").read_text()
    assert command.args == [".venv/bin/activate"] and re.search(r"^VENV\s*\?=\s*\.venv$", makefile, re.M)


def check_export(command, monkeypatch):
    """A variable something here reads: torchrun's OMP_NUM_THREADS, or the scripts' own."""
    for assignment in command.args:
        name = assignment.split("=", 1)[0]
        assert name == "OMP_NUM_THREADS" or name in (ROOT / "slurm" / "common.sh").read_text(), command.line


CHECKS = {"minddp": check_tool, "python": check_python, "torchrun": check_python, "make": check_make,
          "sbatch": check_script, "source": check_source, "export": check_export, "pip": check_pip}


def check_for(command):
    return check_script if command.prog.startswith("slurm/") else CHECKS.get(command.prog)


@pytest.mark.parametrize("command", [
    pytest.param(c, id=c.line[:70], marks=[pytest.mark.slow] if c.prog.startswith(SLOW) else [])
    for c in COMMANDS])
def test_every_readme_command_runs_in_a_form_without_a_cluster(command, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a relative path in a command (a tool's --out) is made here, if at all
    check = check_for(command)
    assert check, f"README.md prints `{command.line}` and no check here covers `{command.prog}`: add one"
    check(command, monkeypatch)


def test_the_readme_prints_every_slurm_script_and_each_kind_of_command():
    shown = {ROOT / w for c in COMMANDS for w in [c.prog, *c.args] if w.startswith("slurm/")}
    assert shown == {s for s in SCRIPTS if s.name != "common.sh"}, sorted(map(str, shown))
    assert {c.prog for c in COMMANDS} >= {"make", "minddp", "python", "torchrun", "sbatch"}


def test_the_checks_catch_what_cannot_run(monkeypatch):
    """A bad tool argument, a misspelled key, a program no check covers: each fails."""
    with pytest.raises(SystemExit):
        check_tool(Command("", {}, "minddp", ["scaling", "--mode", "sideways"]), monkeypatch)
    with pytest.raises(Exception, match="max_stepz"):
        check_python(Command("", {}, "python", ["train.py", "train.max_stepz=5"]), monkeypatch)
    with pytest.raises(SyntaxError):
        check_python(Command("", {}, "python", ["-c", "import ("]), monkeypatch)
    with pytest.raises(AssertionError, match="extras"):
        check_pip(Command("pip install 'minddp[gpu]'", {}, "pip", ["install", "minddp[gpu]"]), monkeypatch)
    with pytest.raises(Exception, match="max_stepz"):
        check_overrides(["-m", "train.max_stepz=1,2"])
    assert check_for(Command("", {}, "deepspeed", [])) is None


@pytest.mark.slow
def test_the_script_and_make_checks_catch_what_cannot_run(monkeypatch):
    with pytest.raises(AssertionError, match="make -n"):
        check_make(Command("make no-such-target", {}, "make", ["no-such-target"]), monkeypatch)
    sweep = ["--array=0-3", "slurm/sweep.sbatch"]  # four tasks, three values
    with pytest.raises(AssertionError, match="no value"):
        check_script(Command("sbatch", {"SWEEP_KEY": "nproc", "SWEEP_VALUES": "1 2 4"}, "sbatch", sweep),
                     monkeypatch)
    with pytest.raises(AssertionError, match="HEAD"):
        check_script(Command("slurm/multinode_manual.sh", {}, "slurm/multinode_manual.sh", []), monkeypatch)


README_TARGETS = sorted(set(re.findall(r"`make ([a-z][\w-]*)", (ROOT / "README.md").read_text())))


@pytest.mark.slow
@pytest.mark.parametrize("target", README_TARGETS)
def test_every_make_target_the_readme_names_in_its_prose_passes_make_n(target):
    p = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"README: make {target}: make -n: {p.stderr[-2000:]}"
