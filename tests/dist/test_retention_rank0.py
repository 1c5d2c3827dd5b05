"""Retention as the trainer applies it, after the save's last collective, on rank 0 alone: whatever
goes wrong there is one warning, never an exception that leaves rank 0 out of the next step's
collective while its peers wait (a group of one: the rule is rank 0's)."""

import logging

import torch.distributed as dist
from omegaconf import OmegaConf

from minddp.train import checkpoint
from minddp.train.checkpoint import store
from minddp.train.checkpoint.manager import CheckpointManager
from tests.files import TINY_STATE


def _names(run):
    return [p.name for p in checkpoint.all_checkpoints(run)]


def _files(run, steps):
    return [checkpoint.save(run, s, {**TINY_STATE, "step": s}) for s in steps]


def test_retention_that_fails_in_any_way_is_one_warning_on_rank_0_and_the_run_goes_on(tmp_path, monkeypatch,
                                                                                     caplog):
    """Rank 0 applies retention alone, after the last collective: anything it raised (a MemoryError
    while listing, ESTALE) would leave its peers waiting in the next step's collective."""
    paths = _files(tmp_path, range(1, 4))
    t = OmegaConf.create({"ckpt_every": 1, "ckpt_format": "file", "ckpt_async": "auto", "ckpt_keep": 1,
                          "ckpt_keep_every": None, "timeout_s": 30})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        manager = CheckpointManager(tmp_path, t, "cpu", say=lambda line: None)

        def exhausted(run_dir):
            raise MemoryError("listing")

        monkeypatch.setattr(store, "all_checkpoints", exhausted)
        with caplog.at_level(logging.WARNING, logger="minddp"):
            manager.after_step(3, False, lambda step, background: paths[-1])
    finally:
        dist.destroy_process_group()
    monkeypatch.undo()
    assert "retention: nothing deleted after ckpt_00000003.pt (MemoryError: listing)" in caplog.text
    assert _names(tmp_path) == ["ckpt_00000003.pt", "ckpt_00000002.pt", "ckpt_00000001.pt"]
