"""The run directory, from the one place that decides it to every reader.

`conf/config.yaml` sets `hydra.run.dir` (and `hydra.sweep.dir`) to the `minddp.run_dir`
resolver (`config.default_run_dir`: MINDDP_RUN_DIR, the run dir `train.resume` names,
torchrun's run id, the process's start time): Hydra resolves it once per job, makes it, and
train.py hands `HydraConfig`'s `runtime.output_dir` to the Trainer, which passes it down.

`CheckRunDir` is a Hydra callback (conf/config.yaml's `hydra.callbacks`): it checks the
folder Hydra is about to make before Hydra makes it, so a read-only place is one line and
exit 2 instead of Hydra's traceback. `.hydra/` is written by rank 0 once the run holds the
run dir's lock and was accepted (`save_record`): Hydra would write it before the job starts,
which would overwrite the record of a live job, or of the folder's last real run, with a
run that is then refused.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from ...errors import ConfigError
from ...parallel.dist import env_rank


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


class CheckRunDir(Callback):
    """Before Hydra makes the run (or sweep) dir: writable, or one line on stderr and exit 2."""

    def on_run_start(self, config, **kwargs) -> None:
        self._check(config.hydra.run.dir)

    def on_multirun_start(self, config, **kwargs) -> None:
        self._check(config.hydra.sweep.dir)

    @staticmethod
    def _check(run_dir: str) -> None:
        try:
            check_writable(run_dir)
        except ConfigError as e:
            sys.stderr.write(f"[rank {env_rank()}] minddp: configuration error: {e}\n")
            sys.exit(2)  # SystemExit passes Hydra's error handler, which would print a traceback


def save_record(config: dict, run_dir: str) -> None:
    """.hydra/{config,hydra,overrides}.yaml, as Hydra writes them (conf/: its output_subdir is
    null, see above). Rank 0 only, once the run is accepted."""
    hydra_cfg = HydraConfig.get()
    folder = Path(run_dir) / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), folder / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(hydra_cfg)}), folder / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), folder / "overrides.yaml")
