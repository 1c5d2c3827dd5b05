"""Never hang, never lose work: fingerprints, flight recorder, consistency, bad input."""


import os

import pytest
import torch

from minddp.errors import ConfigError
from minddp.parallel.dist import env_ranks
from minddp.train import checkpoint
from minddp.train.metrics import flight_recorder
from tests.files import RunsCode

FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


def test_configure_turns_on_torchs_recorder_and_never_overrides_an_export(tmp_path, monkeypatch):
    for name in FR_VARS:  # set then deleted, so that monkeypatch restores the original state
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    flight_recorder.configure(0, tmp_path)  # train.flight_recorder=0: nothing set
    assert not any(name in os.environ for name in FR_VARS) and not flight_recorder.recording()
    flight_recorder.configure(100, tmp_path)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "100" and flight_recorder.recording()
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "watchdog_rank")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert (tmp_path / "flight_recorder").is_dir()  # nccl's watchdog may write there before any dump
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "7")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/elsewhere/fr")
    flight_recorder.configure(2000, tmp_path / "other")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "7"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/elsewhere/fr"


# ------------------------------------------------------------ checkpoints
def test_checkpoint_whose_pickle_runs_code_is_refused(tmp_path):
    RunsCode.marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "optimizer": {}, "scheduler": {}, "step": 1, "payload": RunsCode()}, evil)
    assert not RunsCode.marker.exists()
    with pytest.raises(checkpoint.CheckpointError, match="refused.*could run code"):
        checkpoint.load(evil, "cpu")
    assert not RunsCode.marker.exists()  # and nothing ran


def test_incomplete_torchrun_environment_is_named():
    with pytest.raises(ConfigError, match="LOCAL_RANK, WORLD_SIZE not set"):
        env_ranks({"RANK": "0"})
    assert env_ranks({}) == (0, 0, 1)
    assert env_ranks({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
                      "SLURM_STEP_ID": "0"}) == (3, 1, 4)
