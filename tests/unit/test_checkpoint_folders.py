"""The folder format on its own (minddp/train/checkpoint/folders.py), in one process: what a
save splits off for DCP and a load joins back, ZeRO-1's parts, user data that looks like a
reference, and what start-up does with the folders a crash left."""

import shutil

import torch

from minddp.optim.zero_state import Piece
from minddp.train.checkpoint import CheckpointError, folders, remove_crash_leftovers
from tests.files import write_folder


def test_a_saved_state_comes_back_whole_with_its_parts_joined_and_user_data_untouched(tmp_path):
    w = torch.arange(12.0).view(3, 4)
    state = {"model": {"w": w, "scalar": torch.tensor(2.0)},
             "optimizer": {"state": {0: {"exp_avg": Piece((3, 4), 0, torch.arange(12.0) * 2),
                                         "step": torch.tensor(5.0)}}, "param_groups": [{"lr": 0.1}]},
             "config": {"note": {folders.REF: "model/w"}}, "step": 7}  # looks like a reference
    write_folder(tmp_path / "ckpt_00000007", state)
    got = folders.load_folder(tmp_path / "ckpt_00000007", "cpu")
    assert torch.equal(got["model"]["w"], w) and got["model"]["scalar"].item() == 2.0
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], (torch.arange(12.0) * 2).view(3, 4))
    assert got["config"] == {"note": {folders.REF: "model/w"}} and got["step"] == 7


def test_parts_that_do_not_tile_the_tensor_are_corrupt(tmp_path):
    state = {"model": {}, "optimizer": {"state": {0: {"exp_avg": Piece((8,), 3, torch.ones(5))}}}}
    write_folder(tmp_path / "ckpt_00000001", state)
    try:
        folders.FOLDER.load(tmp_path / "ckpt_00000001", "cpu")
        raise AssertionError("a tensor with a hole loaded")
    except CheckpointError as e:
        assert "is corrupt: the stored parts of optimizer/state/0/exp_avg hold 5 of its 8 elements" in str(e)


def test_start_up_puts_a_whole_folder_whose_rename_was_cut_in_place_and_removes_the_rest(tmp_path):
    d = tmp_path / "checkpoints"
    write_folder(d / "ckpt_00000006", {"model": {"w": torch.ones(3)}, "step": 6})
    whole = d / ".ckpt_00000006.tmp-0000abcd"  # integrity.json written, the rename cut by a crash
    (d / "ckpt_00000006").rename(whole)
    shutil.copytree(whole, d / ".ckpt_00000006.old-0000ef01")  # the folder it was replacing
    half = d / ".ckpt_00000007.tmp-12345678"  # a save a crash cut before its commit
    shutil.copytree(whole, half)
    (half / "integrity.json").unlink()
    removed = remove_crash_leftovers(tmp_path)
    assert sorted(p.name for p in d.iterdir()) == ["ckpt_00000006"]
    assert sorted(p.name for p in removed) == [".ckpt_00000006.old-0000ef01", ".ckpt_00000007.tmp-12345678"]
    assert folders.load_folder(d / "ckpt_00000006", "cpu")["step"] == 6


def test_a_same_step_save_that_fails_keeps_the_folder_it_was_replacing(tmp_path, monkeypatch):
    """publish sets the old folder aside, then renames the new one in: a failure between the two
    (or a crash, the new one not whole) once left the step with no checkpoint at all."""
    d = tmp_path / "checkpoints"
    write_folder(d / "ckpt_00000006", {"model": {"w": torch.ones(3)}, "step": 6})
    new = d / ".ckpt_00000006.tmp-0000abcd"
    write_folder(new, {"model": {"w": torch.zeros(3)}, "step": 6})
    (new / "integrity.json").unlink()
    real_rename = type(new).rename

    def refused(self, target):
        if self == new:
            raise OSError(5, "Input/output error")
        return real_rename(self, target)

    monkeypatch.setattr(type(new), "rename", refused)
    try:
        folders.publish(new, d / "ckpt_00000006", {})
        raise AssertionError("the failed rename was not raised")
    except OSError:
        pass
    monkeypatch.undo()
    assert torch.equal(folders.load_folder(d / "ckpt_00000006", "cpu")["model"]["w"], torch.ones(3))

    aside = d / ".ckpt_00000006.old-0000ef01"  # a kill between the renames, the new one cut short
    (d / "ckpt_00000006").rename(aside)
    (new / "integrity.json").unlink()
    assert remove_crash_leftovers(tmp_path) == [new]
    assert sorted(p.name for p in d.iterdir()) == ["ckpt_00000006"]
    assert torch.equal(folders.load_folder(d / "ckpt_00000006", "cpu")["model"]["w"], torch.ones(3))
