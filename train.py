"""minddp's trainer: a small GPT (or MLP) on real text, data-parallel by hand.

One process:                 python train.py
N processes on this machine: torchrun --standalone --nproc_per_node=N train.py
Several nodes (run on every node, same command, HEAD = the first node's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
             --rdzv_endpoint=HEAD:29500 --rdzv_id=myjob train.py
Any key can be overridden: train.max_steps=50 model=mlp data=synthetic ddp.bucket_cap_mb=5
Your own token files:        python train.py data=tokens data.dir=path/to/folder

This file is the Hydra entry and the error reporting; the loop is minddp/train/trainer.py.
"""

from __future__ import annotations

import os

os.environ["MINDDP_WORKER_PARENT"] = f"{os.getpid()}:{os.getppid()}"  # first (minddp.parallel.agent)

import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from minddp.parallel.agent import stop_with_agent
from minddp.parallel.dist import env_rank, env_ranks, exit_worker, shutdown, wait_for_peers
from minddp.train.config import ConfigError, register, unknown_key_hint, value_hint
from minddp.train.io import run_dir as run_dirs
from minddp.train.metrics import flight_recorder
from minddp.train.safety.guard import DivergedError
from minddp.train.trainer import Trainer

register()
_entered_main = False  # False when Hydra fails before main runs: its own config error
_exit_code = 0  # 130 after a Ctrl-C that stopped the run cleanly (checkpoint saved)
_raise_hydra_errors = ""  # "1" while run() has Hydra raise its command-line errors (HYDRA_FULL_ERROR)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _entered_main, _exit_code
    _entered_main = True
    if _raise_hydra_errors:  # from here on errors are the run's own: Hydra reports them its usual way
        os.environ.pop("HYDRA_FULL_ERROR", None)
    run_dir = HydraConfig.get().runtime.output_dir
    rank = env_rank()
    as_given = OmegaConf.to_container(cfg)  # .hydra/config.yaml: before setup records the data's values
    try:
        trainer = Trainer(cfg, run_dir)  # Hydra made run_dir (conf/: hydra.run.dir, hydra.callbacks)
        trainer.setup()  # holds the run dir's lock, or every rank exits 2
        if env_ranks()[0] == 0:  # .hydra/ once the run is accepted: a refused run leaves it as it was
            run_dirs.save_record(as_given, run_dir)
        trainer.fit()
        _exit_code = trainer.stop.exit_code
    except (ConfigError, DivergedError) as e:  # a clear message and exit code 2 (3) on every rank
        config = isinstance(e, ConfigError)
        say(rank, f"minddp: {'configuration error' if config else 'stopped'}: {e}")
        wait_for_peers(f"minddp/{type(e).__name__}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        shutdown()
        if config:  # every rank, after all reported: a node of its own has its own folder
            remove_if_empty(run_dir)
        sys.exit(2 if config else 3)
    except BaseException as e:  # everything else: this rank's own report, and the flight recorder
        say(rank, f"minddp: {type(e).__name__}: {e}")
        report_flight_recorder(rank, run_dir, e)
        raise
    finally:
        shutdown()


def remove_if_empty(run_dir: str) -> None:
    """A refused run leaves no empty outputs/<date>/<time>/ (Hydra made it before main ran): the
    folder and its emptied parents go, never past the working directory."""
    path, top = Path(run_dir).resolve(), Path.cwd().resolve()
    while top in path.parents:
        try:
            path.rmdir()  # only an empty folder
        except OSError:
            return
        path = path.parent


def say(rank, text: str) -> None:
    """One rank's line on stderr in one write: print() writes the text and its newline apart, and
    with unbuffered output (PYTHONUNBUFFERED) two ranks' lines then run together."""
    sys.stderr.write(f"[rank {rank}] {text}\n")
    sys.stderr.flush()


def report_flight_recorder(rank, run_dir, e: BaseException) -> None:
    """Dump the recorder after the error line is out: a dump that fails too (a full disk)
    must not hide why the rank stopped."""
    try:
        where = flight_recorder.dump(run_dir, f"{type(e).__name__}: {e}")
    except Exception as d:  # noqa: BLE001
        say(rank, f"flight recorder: no dump ({type(d).__name__}: {d})")
        return
    if where:
        say(rank, f"flight recorder: {where}; minddp debug {run_dir}")


def hydra_problem(e: HydraException) -> str:
    """Hydra's refusal of the command line as one line with the fix (Hydra's own advice for an
    unknown key is `+key=...`, which only adds a setting nothing reads)."""
    cause = e.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        given = re.search(r"Could not override '([^']+)'", str(e))  # the whole key (trian.max_steps)
        key = given.group(1) if given else cause.full_key
        return f"unknown key {key} ({unknown_key_hint(key)})"
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        return f"{cause.full_key}: {str(cause).splitlines()[0]}{value_hint(str(cause.full_key))}"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if isinstance(e, MissingConfigException) and "Available options" in str(e):
        options = [o for o in lines[2:lines.index("Config search path:")] if not o.endswith("_schema")]
        return f"{lines[0].split(': ', 1)[-1]} (options: {', '.join(options)})"  # "In 'config': Could not..."
    if isinstance(e, OverrideParseException):
        return f"cannot read the command line ({lines[0]}): overrides are key=value"
    return lines[0] if lines else type(e).__name__


def run() -> None:
    """main(), with Hydra's refusal of the command line (unknown key, wrong type, bad override)
    as one line with the fix and exit code 2, on every rank. While HYDRA_FULL_ERROR is set Hydra
    raises these instead of printing its own lines; main() unsets it again, so the run's own
    errors are reported Hydra's usual way. A HYDRA_FULL_ERROR you set yourself gets Hydra's trace."""
    global _raise_hydra_errors
    stop_with_agent("its checkpoints are whole: train.resume=auto continues the run")  # under torchrun
    rank = env_rank()
    if "HYDRA_FULL_ERROR" not in os.environ:
        os.environ["HYDRA_FULL_ERROR"] = _raise_hydra_errors = "1"
    try:
        main()  # errors raise (and exit non-zero) before the line below
    except (HydraException, OmegaConfBaseException) as e:
        if not _raise_hydra_errors or _entered_main:
            raise
        say(rank, f"minddp: configuration error: {hydra_problem(e)}")
        wait_for_peers(f"minddp/hydra/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        exit_worker(2, script=True)  # at once: a slow interpreter teardown lets torchrun kill this rank
    except SystemExit as e:  # the run's error, reported (Hydra's exit 1, or 2, 3): its code, without
        # the teardown, which aborts (SIGABRT) under a thread still inside a collective (a stuck write)
        exit_worker(e.code if isinstance(e.code, int) else 1, script=True)
    exit_worker(_exit_code, script=True)  # without the interpreter's teardown (see exit_worker)


if __name__ == "__main__":
    run()
