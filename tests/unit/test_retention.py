"""Retention (train.ckpt_keep, train.ckpt_keep_every) on its own: which checkpoints go, that they
go only once a newer one reads back, that a deletion is a rename out of the listing first (a kill
between the two leaves nothing a resume would try), and that a deletion that fails loses nothing."""

import errno
import logging
from pathlib import Path

import pytest

from minddp.train import checkpoint
from minddp.train.checkpoint import store
from minddp.train.checkpoint.folders import FOLDER
from minddp.train.checkpoint.retention import Retention
from tests.files import TINY_STATE, corrupt, save_file, write_folder


def _names(run):
    return [p.name for p in checkpoint.all_checkpoints(run)]


def _files(run, steps):
    return [save_file(run, s, {**TINY_STATE, "step": s}) for s in steps]


def _paths(*steps, folder=()):
    d = Path("/run/checkpoints")
    return [d / f"ckpt_{s:08d}{'' if s in folder else '.pt'}" for s in steps]


def test_the_newest_n_stay_counted_from_the_one_just_saved_and_milestones_stay_forever():
    found = _paths(9, 8, 7, 6, 5, 4, 3, 2, 1)
    assert Retention(3).to_delete(found, found[0]) == _paths(6, 5, 4, 3, 2, 1)
    assert Retention(3, 4).to_delete(found, found[0]) == _paths(6, 5, 3, 2, 1)  # 8 and 4: milestones
    assert Retention(1).to_delete(found, found[0]) == found[1:]
    assert Retention(0, 4).to_delete(found, found[0]) == []  # 0: keep all
    assert Retention(20).to_delete(found, found[0]) == []


def test_checkpoints_newer_than_the_one_saved_are_neither_counted_nor_deleted():
    """A resume that skipped a corrupt step 9 saves step 7 again: 9 is no reason to delete 6."""
    found = _paths(9, 7, 6, 5)
    assert Retention(2).to_delete(found, found[1]) == _paths(5)


def test_a_folder_and_a_file_of_one_step_are_two_checkpoints():
    found = _paths(4, 4, 3, folder=(4,))[:1] + _paths(4, 3)
    assert Retention(2).to_delete(found, found[0]) == _paths(3)


def test_the_settings_read_zero_and_null_as_keep_everything():
    assert Retention.of(None, None) == Retention(0, 0) and Retention.of(3, 1000) == Retention(3, 1000)
    assert "keeping every checkpoint" in Retention(0).describe()
    assert Retention(3, 1000).describe() == ("keeping the newest 3 (train.ckpt_keep) and those at steps "
                                             "divisible by 1000 (train.ckpt_keep_every)")


def test_apply_deletes_the_rest_of_a_real_run_and_leaves_no_trash(tmp_path):
    paths = _files(tmp_path, range(1, 7))
    deleted = Retention(2, 4).apply(tmp_path, paths[-1])
    assert [p.name for p in deleted] == ["ckpt_00000003.pt", "ckpt_00000002.pt", "ckpt_00000001.pt"]
    assert _names(tmp_path) == ["ckpt_00000006.pt", "ckpt_00000005.pt", "ckpt_00000004.pt"]
    assert [p.name for p in store.checkpoint_dir(tmp_path).iterdir() if p.name.startswith(".")] == []


def test_nothing_is_deleted_when_the_newest_file_does_not_read_back(tmp_path, caplog):
    paths = _files(tmp_path, range(1, 5))
    corrupt(paths[-1], "flipped bit")
    with caplog.at_level(logging.WARNING, logger="minddp"):
        assert Retention(1).apply(tmp_path, paths[-1]) == []
    assert len(_names(tmp_path)) == 4
    assert "retention: nothing deleted, the newest checkpoint does not read back" in caplog.text


def test_a_deletion_that_fails_is_one_warning_and_loses_nothing(tmp_path, monkeypatch, caplog):
    """A rename refused (a full disk's metadata, a read-only folder, a quota): the checkpoint stays
    whole, older ones stay, the run goes on."""
    paths = _files(tmp_path, range(1, 5))
    before = {p: p.read_bytes() for p in paths}

    def refused(self, target):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "rename", refused)
    with caplog.at_level(logging.WARNING, logger="minddp"):
        assert Retention(1).apply(tmp_path, paths[-1]) == []
    monkeypatch.undo()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "could not delete" in lines[0] and "No space left on device" in lines[0]
    assert "kept and the run goes on" in lines[0]
    assert {p: p.read_bytes() for p in paths} == before


def test_a_kill_between_the_rename_and_the_removal_leaves_nothing_a_resume_would_try(tmp_path, caplog):
    paths = _files(tmp_path, range(1, 4))

    def killed():
        raise KeyboardInterrupt  # stands for kill -9: nothing after the rename runs

    with pytest.raises(KeyboardInterrupt):
        store.discard(paths[0], pause=killed)
    assert _names(tmp_path) == ["ckpt_00000003.pt", "ckpt_00000002.pt"]
    (trash,) = store.trash_left(tmp_path)
    assert trash.name.startswith(".ckpt_00000001.pt.trash-")
    path, state = checkpoint.resolve(tmp_path, "auto", "cpu")
    assert path == paths[-1] and state["step"] == 3
    with caplog.at_level(logging.WARNING, logger="minddp"):
        checkpoint.remove_crash_leftovers(tmp_path)
    assert store.trash_left(tmp_path) == [] and "whose deletion was interrupted" in caplog.text


def test_folders_and_files_go_by_the_same_rule_each_through_its_format(tmp_path):
    d = store.checkpoint_dir(tmp_path)
    _files(tmp_path, (1, 2))
    for s in (3, 4):
        write_folder(d / f"ckpt_{s:08d}", {**TINY_STATE, "step": s})
    newest = d / "ckpt_00000004"
    FOLDER.open(newest, "cpu")  # whole: its sizes and small files' checksums hold
    assert [p.name for p in Retention(2).apply(tmp_path, newest)] == ["ckpt_00000002.pt", "ckpt_00000001.pt"]
    assert _names(tmp_path) == ["ckpt_00000004", "ckpt_00000003"]
    assert [p.name for p in Retention(1).apply(tmp_path, newest)] == ["ckpt_00000003"]
    assert _names(tmp_path) == ["ckpt_00000004"] and not list(d.glob(".*"))
    assert checkpoint.load(newest, "cpu")["step"] == 4


def test_the_disk_a_run_takes_counts_every_file_under_checkpoints(tmp_path):
    paths = _files(tmp_path, (1, 2))
    assert store.disk_bytes(tmp_path) >= sum(p.stat().st_size for p in paths)
    assert store.disk_bytes(tmp_path / "none") == 0


# ------------------------------------------------------------------ the settings
@pytest.mark.parametrize("overrides,message", [
    (["train.ckpt_keep=-1"], "train.ckpt_keep=-1 must be >= 0 (train.ckpt_keep: the newest N checkpoints"),
    (["train.ckpt_keep_every=-5"], "train.ckpt_keep_every=-5 must be >= 0"),
    (["train.ckpt_async=maybe"], "train.ckpt_async must be auto, true or false, got 'maybe'"),
    (["train.ckpt_format=file", "train.ckpt_async=true"], "set train.ckpt_format=dcp too"),
])
def test_bad_checkpoint_settings_are_one_line_naming_the_fix(overrides, message):
    from minddp.errors import ConfigError
    from minddp.train.config import register, validate
    from tests.conftest import compose_config

    register()
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*overrides), 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_defaults_are_folders_async_where_it_pays_and_the_newest_three():
    from minddp.train.config import register
    from tests.conftest import compose_config

    register()
    t = compose_config().train
    assert (str(t.ckpt_format), t.ckpt_async, t.ckpt_keep, t.ckpt_keep_every) == ("dcp", "auto", 3, None)
    for given in ("train.ckpt_async=true", "train.ckpt_async=false", "train.ckpt_keep=null"):
        compose_config(given)  # the old spellings still compose


def test_async_auto_is_on_for_cuda_folders_only_and_an_explicit_choice_wins():
    on = checkpoint.background_saves
    assert on("auto", "dcp", "cuda") == (True, "train.ckpt_async=auto: on for cuda")
    assert on("auto", "dcp", "cpu") == (False, "train.ckpt_async=auto: off for cpu")
    assert on("auto", "file", "cuda")[0] is False
    assert on(True, "dcp", "cpu") == (True, "train.ckpt_async=true")
    assert on(False, "dcp", "cuda") == (False, "train.ckpt_async=false")


def test_a_trash_left_that_cannot_be_removed_is_a_warning_at_start_up_never_an_error(tmp_path, monkeypatch,
                                                                                  caplog):
    """Rank 0 cleans up before the resume's broadcast: a removal refused there (permissions, NFS's
    busy `.nfs` files) raised on rank 0 alone while its peers waited in the broadcast."""
    paths = _files(tmp_path, range(1, 4))
    def killed():
        raise KeyboardInterrupt  # stands for kill -9 between the rename and the removal

    with pytest.raises(KeyboardInterrupt):
        store.discard(paths[0], pause=killed)

    def refused(self, missing_ok=False):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "unlink", refused)
    with caplog.at_level(logging.WARNING, logger="minddp"):
        checkpoint.remove_crash_leftovers(tmp_path)
    monkeypatch.undo()
    assert "could not remove" in caplog.text and "Permission denied" in caplog.text
    assert len(store.trash_left(tmp_path)) == 1
    assert checkpoint.resolve(tmp_path, "auto", "cpu")[0] == paths[-1]



# --------------------------------------------- issue 56.2 and 56.11: what counts toward ckpt_keep
def test_checkpoints_that_do_not_count_never_take_a_slot_and_the_way_back_stays():
    """A streak's checkpoints (steps skipped as non-finite when saved) and known corrupt ones do
    not count: the newest `keep` that count stay (the way back from before a divergence), beside
    the newest `keep` of any kind; the rest goes, the streak's older ones too."""
    found = _paths(20, 18, 16, 14, 12, 10, 8, 6, 4, 2)
    streak = set(_paths(20, 18, 16, 14, 12))
    counts = lambda p: p not in streak  # noqa: E731
    assert Retention(3).to_delete(found, found[0], counts) == _paths(14, 12, 4, 2)
    assert Retention(3, 4).to_delete(found, found[0], counts) == _paths(14, 2)  # 12 and 4: milestones
    assert Retention(3).to_delete(found, found[0]) == _paths(14, 12, 10, 8, 6, 4, 2)  # all counted: as before
    healed = _paths(26, 24, 22) + found  # healthy saves past the streak: the way back may go now
    assert Retention(3).to_delete(healed, healed[0], counts) == _paths(20, 18, 16, 14, 12, 10, 8, 6, 4, 2)


def test_a_checkpoint_counts_unless_its_small_state_says_a_streak_or_does_not_read(tmp_path):
    from minddp.train.checkpoint.formats import STREAK, saved_healthy

    d = checkpoint.checkpoint_dir(tmp_path)
    old = save_file(tmp_path, 1, {**TINY_STATE, "step": 1})  # saved before the key existed
    calm = save_file(tmp_path, 2, {**TINY_STATE, "step": 2, STREAK: 0})
    streak = save_file(tmp_path, 3, {**TINY_STATE, "step": 3, STREAK: 2})
    folder = write_folder(d / "ckpt_00000004", {**TINY_STATE, "step": 4, STREAK: 1})
    broken = save_file(tmp_path, 5, {**TINY_STATE, "step": 5})
    corrupt(broken, "truncated:100")
    got = [saved_healthy(p) for p in (old, calm, streak, folder, broken)]
    assert got == [True, True, False, False, False]
    assert saved_healthy(write_folder(d / "ckpt_00000006", {**TINY_STATE, "step": 6}))


def test_settings_that_do_less_than_they_seem_are_said_at_start_up():
    assert Retention(0, 5).describe() == ("keeping every checkpoint (train.ckpt_keep=0; "
                                          "train.ckpt_keep_every=5 changes nothing)")
    said = Retention(3, 2).caveat(ckpt_every=4)
    assert said.startswith("train.ckpt_keep_every=2 divides train.ckpt_every=4: every checkpoint is a "
                           "milestone kept forever, so train.ckpt_keep=3 deletes none")
    assert Retention(3, 1).caveat(ckpt_every=1) is not None
    assert Retention(3, 8).caveat(ckpt_every=4) is None and Retention(3, 6).caveat(ckpt_every=4) is None
    assert Retention(0, 2).caveat(ckpt_every=4) is None and Retention(3, 2).caveat(ckpt_every=0) is None


def test_folders_named_like_temporary_files_are_left_with_a_warning_not_a_traceback(tmp_path, caplog):
    """Start-up clean-up once unlinked them and stopped with IsADirectoryError."""
    _files(tmp_path, [2])
    d = checkpoint.checkpoint_dir(tmp_path)
    dirs = [d / ".ckpt_00000004.pt.k3j_9x2a.tmp", d / ".ckpt_00000004.pt.tmp12345-9f3a",
            tmp_path / ".metrics.jsonl.abc123.tmp"]
    for p in dirs:
        (p / "inside").mkdir(parents=True)
    orphan = d / ".ckpt_00000006.pt.zz.tmp"
    orphan.write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="minddp"):
        removed = checkpoint.remove_crash_leftovers(tmp_path)
    assert removed == [orphan] and not orphan.exists()
    assert all((p / "inside").is_dir() for p in dirs)
    assert caplog.text.count("is a folder named like the temporary file of an interrupted write") == 3
