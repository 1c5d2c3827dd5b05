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

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from minddp.dist import env_ranks, exit_worker, shutdown, wait_for_peers
from minddp.train import flight_recorder
from minddp.train.config import ConfigError, register, validate
from minddp.train.trainer import Trainer

register()
_entered_main = False  # False when Hydra fails before main runs: its own config error


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _entered_main
    _entered_main = True
    run_dir = HydraConfig.get().runtime.output_dir
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    try:
        validate(cfg, env_ranks()[2])  # config errors before any process group starts
        trainer = Trainer(cfg, run_dir)
        trainer.setup()
        trainer.fit()
    except ConfigError as e:  # bad input: a clear message and exit code 2 on every rank
        print(f"[rank {rank}] minddp: configuration error: {e}", file=sys.stderr, flush=True)
        wait_for_peers(f"minddp/config_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        shutdown()
        sys.exit(2)
    except BaseException as e:  # everything else: this rank's own report, and the flight recorder
        print(f"[rank {rank}] minddp: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        report_flight_recorder(rank, run_dir, e)
        raise
    finally:
        shutdown()


def report_flight_recorder(rank, run_dir, e: BaseException) -> None:
    """Dump the recorder after the error line is out: a dump that fails too (a full disk)
    must not hide why the rank stopped."""
    try:
        where = flight_recorder.dump(run_dir, f"{type(e).__name__}: {e}")
    except Exception as d:  # noqa: BLE001
        print(f"[rank {rank}] flight recorder: no dump ({type(d).__name__}: {d})", file=sys.stderr,
              flush=True)
        return
    if where:
        print(f"[rank {rank}] flight recorder: {where}; minddp debug {run_dir}", file=sys.stderr, flush=True)


def run() -> None:
    """main(), with Hydra's own errors (unknown key, wrong type, bad override) as exit code 2:
    Hydra prints them and exits 1 before main runs."""
    try:
        main()  # errors raise (and exit non-zero) before the line below
    except SystemExit as e:
        if e.code == 1 and not _entered_main:
            rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
            print(f"[rank {rank}] minddp: configuration error (Hydra's message above)", file=sys.stderr,
                  flush=True)
            sys.exit(2)
        raise
    exit_worker()


if __name__ == "__main__":
    run()
