"""Retention as the trainer applies it, after the save's last collective, on rank 0 alone: whatever
goes wrong there is one warning, never an exception that leaves rank 0 out of the next step's
collective while its peers wait (a group of one: the rule is rank 0's)."""

import errno
import logging

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from minddp.train import checkpoint
from minddp.train.checkpoint import CheckpointError, store
from minddp.train.checkpoint.manager import CheckpointManager
from tests.files import TINY_STATE, corrupt, save_file


def _names(run):
    return [p.name for p in checkpoint.all_checkpoints(run)]


def _files(run, steps):
    return [save_file(run, s, {**TINY_STATE, "step": s}) for s in steps]


class Tiny:
    """A RunState that saves TINY_STATE and loads nothing: the manager's Stateful piece, planted."""
    device = torch.device("cpu")

    def state_dict(self, step, folder):
        return {**TINY_STATE, "step": step}

    def read_in_place(self, path, saved):
        return 0

    def load_state_dict(self, saved, path):
        return saved["step"] if saved else 0


def _manager(tmp_path, keep=3, every=None, ckpt_every=2):
    t = OmegaConf.create({"ckpt_every": ckpt_every, "ckpt_format": "file", "ckpt_async": "auto",
                          "ckpt_keep": keep, "ckpt_keep_every": every, "timeout_s": 30, "resume": "auto",
                          "resume_force": False})
    return CheckpointManager(tmp_path, t, Tiny())


def test_retention_that_fails_in_any_way_is_one_warning_on_rank_0_and_the_run_goes_on(tmp_path, monkeypatch,
                                                                                     caplog):
    """Rank 0 applies retention alone, after the last collective: anything it raised (a MemoryError
    while listing, ESTALE) would leave its peers waiting in the next step's collective."""
    _files(tmp_path, range(1, 3))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        manager = _manager(tmp_path, keep=1, ckpt_every=1)

        def exhausted(run_dir):
            raise MemoryError("listing")

        monkeypatch.setattr(store, "all_checkpoints", exhausted)
        with caplog.at_level(logging.WARNING, logger="minddp"):
            manager.save(3)
    finally:
        dist.destroy_process_group()
    monkeypatch.undo()
    assert "retention: nothing deleted after ckpt_00000003.pt (MemoryError: listing)" in caplog.text
    assert _names(tmp_path) == ["ckpt_00000003.pt", "ckpt_00000002.pt", "ckpt_00000001.pt"]


@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_saves_during_a_non_finite_streak_never_count_and_the_way_back_stays(tmp_path, group_of_one):
    """Issue 56.2: a run resumed at 10 with optim.lr=1e30 saves 12..20 while every step is
    skipped; retention removed 4..10 and the guard's advice (resume from an earlier checkpoint)
    became impossible. The streak's saves take no slot: 10, 8 and 6 stay."""
    healthy = _files(tmp_path, range(2, 11, 2))
    manager = _manager(tmp_path)
    assert manager.load() == 10
    for step in range(12, 21, 2):  # the guard's count in the state
        manager.save(step, nonfinite_streak=step - 11)
    assert _names(tmp_path) == [f"ckpt_{s:08d}.pt" for s in (20, 18, 16, 10, 8, 6)]
    assert checkpoint.load(healthy[-1], "cpu")["step"] == 10
    # a later run (resumed from 20) reads which ones were a streak's from their small state
    manager = _manager(tmp_path)
    assert manager.load() == 20
    manager.save(22, nonfinite_streak=11)
    assert _names(tmp_path) == [f"ckpt_{s:08d}.pt" for s in (22, 20, 18, 10, 8, 6)]


def test_a_checkpoint_the_resume_skipped_as_corrupt_takes_no_slot(tmp_path, group_of_one):
    """Issue 56.11: resumed at 6 past a corrupt 8, the save at 9 kept 9, 8 and 6: two usable."""
    paths = _files(tmp_path, [2, 4, 6, 8])
    corrupt(paths[-1], "truncated:5000")  # still reads its pickle: only the resume's choice knows
    manager = _manager(tmp_path)
    assert manager.load() == 6  # past the corrupt 8
    manager.save(9, last=True)
    kept = ["ckpt_00000009.pt", "ckpt_00000008.pt", "ckpt_00000006.pt", "ckpt_00000004.pt"]
    assert _names(tmp_path) == kept


def test_a_checkpoints_folder_that_cannot_be_written_is_one_line_at_start_up(tmp_path, group_of_one,
                                                                             monkeypatch):
    """Issue 56.11: found only at the first save before (root writes anywhere: the refusal is
    the filesystem's, here stood in for; tests/e2e/test_retention.py has the real one)."""
    import tempfile

    _files(tmp_path, [2])

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    d = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match=f"cannot write checkpoints in {d} \\(Read-only file system\\): "
                                              f"make it writable \\(chmod u\\+w {d}, or remount it"):
        _manager(tmp_path)
