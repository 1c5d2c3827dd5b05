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
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from minddp.parallel.dist import env_ranks, exit_worker, shutdown, wait_for_peers
from minddp.train.config import ConfigError, default_run_dir, register
from minddp.train.metrics import flight_recorder
from minddp.train.safety.guard import DivergedError
from minddp.train.trainer import Trainer

register()
_entered_main = False  # False when Hydra fails before main runs: its own config error
_exit_code = 0  # 130 after a Ctrl-C that stopped the run cleanly (checkpoint saved)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _entered_main, _exit_code
    _entered_main = True
    run_dir = HydraConfig.get().runtime.output_dir
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    as_given = OmegaConf.to_container(cfg)  # .hydra/config.yaml: before setup records the data's values
    try:
        check_writable(run_dir)
        trainer = Trainer(cfg, run_dir)
        trainer.setup()
        save_hydra_record(as_given, run_dir)
        trainer.fit()
        _exit_code = trainer.stop.exit_code
    except (ConfigError, DivergedError) as e:  # a clear message and exit code 2 (3) on every rank
        config = isinstance(e, ConfigError)
        say(rank, f"minddp: {'configuration error' if config else 'stopped'}: {e}")
        wait_for_peers(f"minddp/{type(e).__name__}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        shutdown()
        sys.exit(2 if config else 3)
    except BaseException as e:  # everything else: this rank's own report, and the flight recorder
        say(rank, f"minddp: {type(e).__name__}: {e}")
        report_flight_recorder(rank, run_dir, e)
        raise
    finally:
        shutdown()


def say(rank, text: str) -> None:
    """One rank's line on stderr in one write: print() writes the text and its newline apart, and
    with unbuffered output (PYTHONUNBUFFERED) two ranks' lines then run together."""
    sys.stderr.write(f"[rank {rank}] {text}\n")
    sys.stderr.flush()


def save_hydra_record(config: dict, run_dir: str) -> None:
    """.hydra/{config,hydra,overrides}.yaml, which Hydra would write before main (conf/: its
    output_subdir is null), written by rank 0 once the run is accepted: a refused run (a bad
    override, a resume refused) leaves the record of the folder's last real run as it was."""
    if env_ranks()[0] != 0:
        return
    hydra_cfg = HydraConfig.get()
    folder = Path(run_dir) / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), folder / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(hydra_cfg)}), folder / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), folder / "overrides.yaml")


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


def check_writable(run_dir: str) -> None:
    """The run dir, or the folder it would be made in, must be writable (a read-only mount, another
    user's folder): one line instead of a traceback from the first file written."""
    folder = Path(run_dir).absolute()
    try:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError:  # a folder above it that this user cannot even look into
        writable = False
    if not writable:
        where = "is" if folder == Path(run_dir).absolute() else f"would be made in {folder}, which is"
        raise ConfigError(f"the run dir {run_dir} {where} not writable: choose another with "
                          "MINDDP_RUN_DIR=<dir> (or hydra.run.dir=<dir>)")


def _planned_run_dir(argv: list[str]) -> str | None:
    """The run dir Hydra will make, when this process can tell before Hydra does (Hydra makes
    it before main runs, and its failure is a traceback)."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    if given:
        return None if "${" in given[0] else given[0]
    multirun = bool({"-m", "--multirun"} & set(argv))
    resume = [a.split("=", 1)[1] for a in argv if a.startswith("train.resume=")] or None
    resume = None if multirun or not resume else resume[-1]
    return default_run_dir("multirun" if multirun else "outputs", resume)


def run() -> None:
    """main(), with Hydra's own errors (unknown key, wrong type, bad override) as exit code 2:
    Hydra prints them and exits 1 before main runs."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    planned = _planned_run_dir(sys.argv[1:])
    try:
        if planned and not {"-h", "--help", "--cfg", "-c", "--info"} & set(sys.argv[1:]):
            check_writable(planned)
    except ConfigError as e:
        say(rank, f"minddp: configuration error: {e}")
        sys.exit(2)
    try:
        main()  # errors raise (and exit non-zero) before the line below
    except SystemExit as e:
        if e.code == 1 and not _entered_main:
            say(rank, "minddp: configuration error (Hydra's message above)")
            sys.exit(2)
        raise
    exit_worker(_exit_code, script=True)  # without the interpreter's teardown (see exit_worker)


if __name__ == "__main__":
    run()
