"""Folder checkpoints (train.ckpt_format=dcp, torch.distributed.checkpoint) keep every promise of
README's "Resume and failures" table: resume at any dp size, sharded or not, from either format
(0.4's files still load); a folder without its integrity.json, with a flipped bit, a truncated or
missing file is corrupt and the previous checkpoint is used; a read error stops the run; a save a
crash interrupted leaves a temporary folder that is removed and never chosen."""

import json
import shutil

import pytest
import torch

from minddp.parallel.mesh import Mesh
from minddp.train import checkpoint
from minddp.train.data import ArithmeticSequences, ShardedBatches
from tests import launch
from tests.conftest import SMALL, assert_same_curves, final_model, metrics
from tests.files import small_disk
from tests.launch import run_train
from tests.training_state import CPU, outcome, save_state, setup, train

ARGS = [*SMALL, "train.max_steps=6", "train.ckpt_every=3", "train.eval_every=0"]
DCP = "train.ckpt_format=dcp"  # the default: named where a test is about it
FILE = "train.ckpt_format=file"
ZERO = "ddp.shard_optimizer=true"


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


@pytest.mark.slow
def test_a_folder_resumes_bitwise_and_at_any_dp_size_sharded_or_not(tmp_path):
    run_train(tmp_path / "ref", *ARGS, nproc=2)
    run_train(tmp_path / "zref", *ARGS, DCP, ZERO, nproc=2)
    # sharded on 2 ranks, each writing its own parts -> the same layout: bitwise
    run_train(tmp_path / "same", *ARGS, DCP, ZERO, "train.stop_at_step=3", nproc=2)
    assert [p.name for p in checkpoint.all_checkpoints(tmp_path / "same")] == ["ckpt_00000003"]
    run_train(tmp_path / "same", *ARGS, DCP, ZERO, "train.resume=auto", nproc=2)
    _equal(final_model(tmp_path / "same"), final_model(tmp_path / "zref"))
    assert [r["loss"] for r in metrics(tmp_path / "same")] == [r["loss"] for r in metrics(tmp_path / "zref")]
    # sharded on 2 ranks -> unsharded on 1 (DCP's parts joined, then whole)
    run_train(tmp_path / "a", *ARGS, DCP, ZERO, "train.stop_at_step=3", nproc=2)
    run_train(tmp_path / "a", *ARGS, DCP, "train.resume=auto", nproc=1)
    # 0.4's format (a file) on 1 rank -> a sharded folder run on 2
    run_train(tmp_path / "b", *ARGS, FILE, "train.stop_at_step=3", nproc=1)
    run_train(tmp_path / "b", *ARGS, DCP, ZERO, "train.resume=auto", nproc=2)
    names = [p.name for p in checkpoint.all_checkpoints(tmp_path / "b")]
    assert names == ["ckpt_00000006", "ckpt_00000003.pt"]
    for run in ("a", "b"):
        assert_same_curves(metrics(tmp_path / run), metrics(tmp_path / "ref"), atol=1e-5)
        for k, v in final_model(tmp_path / "ref").items():
            torch.testing.assert_close(final_model(tmp_path / run)[k], v, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- what a damaged folder does
def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:99])


DAMAGE = {
    "a flipped bit in a rank's file": (lambda f: _flip(f / "__1_0.distcp"),
                                       "checksum mismatch in __1_0.distcp"),
    "a truncated rank's file": (lambda f: _truncate(f / "__0_0.distcp"), "__0_0.distcp holds 99 bytes"),
    "a missing rank's file": (lambda f: (f / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    "no integrity.json (an interrupted commit)": (lambda f: (f / "integrity.json").unlink(),
                                                  "no integrity.json: an interrupted save"),
    "no DCP metadata": (lambda f: (f / ".metadata").unlink(), ".metadata is missing"),
    "a flipped bit in state.pt": (lambda f: _flip(f / "state.pt"), "checksum mismatch in state.pt"),
    "integrity.json that does not parse": (lambda f: (f / "integrity.json").write_text("{"),
                                           "integrity.json does not parse"),
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A ZeRO-1 run on 2 ranks with two folder checkpoints (steps 3 and 6)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    run_train(run, *ARGS, DCP, ZERO, nproc=2)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_folder_is_corrupt_and_the_previous_checkpoint_is_used(saved_run, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    newest, previous = checkpoint.all_checkpoints(run)
    spoil, message = DAMAGE[damage]
    spoil(newest)
    with pytest.raises(checkpoint.CheckpointError, match="is corrupt") as e:
        checkpoint.load(newest, "cpu")
    assert message in str(e.value) and str(newest) in str(e.value)
    path, state = checkpoint.resolve(run, "auto", "cpu")
    assert (path, state["step"]) == (previous, 3)


@pytest.mark.slow
def test_a_folder_loads_into_the_same_state_as_a_file_of_the_same_run(saved_run, tmp_path):
    """Every key a file holds, with the optimizer's state joined into full tensors by index."""
    run_train(tmp_path / "file", *ARGS, FILE, ZERO, nproc=2)
    folder = checkpoint.load(checkpoint.latest(saved_run), "cpu")
    file = checkpoint.load(checkpoint.latest(tmp_path / "file"), "cpu")
    assert folder.keys() == file.keys() - {"checksums"}
    _equal(folder["model"], file["model"])
    assert folder["optimizer"]["param_groups"] == file["optimizer"]["param_groups"]
    for i, st in file["optimizer"]["state"].items():
        _equal(folder["optimizer"]["state"][i], st)
    assert folder["rng"][1]["cpu"].equal(file["rng"][1]["cpu"]) and folder["step"] == file["step"] == 6


@pytest.mark.slow
def test_a_read_error_in_a_folder_stops_the_run_without_falling_back(saved_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    newest = checkpoint.latest(run)
    (newest / "integrity.json").unlink()
    (newest / "integrity.json").symlink_to("/proc/self/mem")  # reading it is a real I/O error (EIO)
    with pytest.raises(checkpoint.CheckpointReadError, match="could not read checkpoint .*ckpt_00000006"):
        checkpoint.resolve(run, "auto", "cpu")


@pytest.mark.slow
def test_a_save_a_crash_interrupted_is_removed_and_never_chosen(saved_run, tmp_path):
    """kill -9 during a folder save leaves `.ckpt_<step>.tmp-<id>/` (DCP's files, no integrity.json)."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    newest = checkpoint.latest(run)
    leftover = newest.with_name(".ckpt_00000009.tmp-0123abcd")
    shutil.copytree(newest, leftover)
    (leftover / "integrity.json").unlink()
    assert checkpoint.latest(run) == newest
    p = run_train(run, *ARGS, DCP, ZERO, "train.max_steps=9", "train.resume=auto", nproc=2)
    assert "resumed from" in p.stdout + p.stderr and not leftover.exists()
    assert [r["step"] for r in metrics(run)] == list(range(1, 10))
    sums = json.loads((checkpoint.latest(run) / "integrity.json").read_text())
    assert checkpoint.latest(run).name == "ckpt_00000009"
    assert {".metadata", "state.pt"} <= sums["files"].keys() and sums["version"] == 2


# ---------------------------------------------------------------- in the background
@pytest.mark.slow
def test_a_background_save_commits_after_the_next_step_and_resumes_bitwise(tmp_path):
    """train.ckpt_async: saves at 2 and 4 written beside steps 3 and 5 and committed after them,
    the last one (5, a stop) in the foreground. A resume from step 4's equals the plain run."""
    args = [*ARGS, DCP, ZERO, "train.ckpt_every=2"]
    run_train(tmp_path / "ref", *args, nproc=2)
    p = run_train(tmp_path / "run", *args, "train.ckpt_async=true", "train.stop_at_step=5", nproc=2)
    said = [line.split("saved ")[1] for line in (p.stdout + p.stderr).splitlines() if "saved " in line]
    assert [s[-2:] for s in said] == ["02", "04", "05"], said
    assert [c.name for c in checkpoint.all_checkpoints(tmp_path / "run")] == [
        "ckpt_00000005", "ckpt_00000004", "ckpt_00000002"]
    assert not list(checkpoint.checkpoint_dir(tmp_path / "run").glob(".ckpt_*"))
    shutil.rmtree(checkpoint.latest(tmp_path / "run"))  # resume from the one written in the background
    run_train(tmp_path / "run", *args, "train.ckpt_async=true", "train.resume=auto", nproc=2)
    _equal(final_model(tmp_path / "run"), final_model(tmp_path / "ref"))


@pytest.mark.slow
def test_a_background_save_needs_the_folder_format(tmp_path):
    p = run_train(tmp_path / "run", *ARGS, FILE, "train.ckpt_async=true", check=False, timeout=60)
    assert p.returncode == 2 and "set train.ckpt_format=dcp too" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_a_folder_is_a_checkpoint_path_for_resume_and_sample(saved_run, tmp_path):
    """train.resume=<run>/checkpoints/ckpt_<step> is that checkpoint (not a run dir to continue),
    and `minddp sample` reads it as it reads a file."""
    from minddp.tools.sample import read_checkpoint

    folder = checkpoint.all_checkpoints(saved_run)[1]
    assert checkpoint.resume_run_dir(str(folder)) is None
    path, state = checkpoint.resolve(tmp_path / "new", str(folder), "cpu")
    assert (path, state["step"]) == (folder, 3)
    assert read_checkpoint(folder)[1]["step"] == 3
    p = run_train(tmp_path / "new", *ARGS, f"train.resume={folder}", nproc=1)
    assert f"resumed from {folder} at step 3" in p.stdout + p.stderr


# ---------------------------------------------------------------- a full disk (real tmpfs)

def _save_on_a_disk_that_fills_up(rank, world, run_dir, small_state_fits):
    import shutil as sh

    import torch.distributed as dist

    mesh = Mesh.create(world, 1, "cpu")
    batches = ShardedBatches(ArithmeticSequences(64, 8, 16), mesh.dp_size, mesh.dp_rank, 2, 1, 0, CPU)
    model, ddp, opt, sched, _ = setup(0, shard=True)
    train(model, ddp, opt, sched, batches, (1,))

    def save(step):
        save_state(run_dir, step, model=model, opt=opt, sched=sched, batches=batches, mesh=mesh, device=CPU,
                   saved_with={}, folder=True, log=lambda line: None)

    save(1)
    if rank == 0:  # leave less than a checkpoint: room for its state.pt (DCP's files fail) or not
        small = (run_dir / "checkpoints/ckpt_00000001/state.pt").stat().st_size
        room = small + 8192 if small_state_fits else 0
        (run_dir / "filler").write_bytes(b"\0" * (sh.disk_usage(run_dir).free - room))
    dist.barrier()
    return outcome(lambda: save(2))


@pytest.mark.slow  # it runs mount(8)
@pytest.mark.parametrize("small_state_fits", [False, True], ids=["rank-0-fails", "dcp-fails"])
def test_a_folder_save_on_a_full_disk_stops_every_rank_and_keeps_the_previous_one(tmp_path, small_state_fits):
    with small_disk(tmp_path / "small", 2) as mnt:
        got = launch.ranks(_save_on_a_disk_that_fills_up, 2, mnt, small_state_fits)
        for kind, text in got:
            assert kind == "CheckpointWriteError", got
            assert "could not write checkpoint" in text or "rank 0 could not save step 2" in text, got
        dcp_said = got[1][1].startswith("could not write checkpoint")  # DCP raises on every rank itself
        assert dcp_said == small_state_fits, got
        assert "MiB free in" in got[0][1], got
        assert "previous checkpoint is intact (ckpt_00000001)" in got[0][1], got
        assert sorted(q.name for q in (mnt / "checkpoints").iterdir()) == ["ckpt_00000001"]  # no leftover
        assert checkpoint.load(mnt / "checkpoints" / "ckpt_00000001", "cpu")["step"] == 1


# ---------------------------------------------------------------- read in place (issue 55.1)
@pytest.mark.slow
def test_a_damaged_item_read_by_one_rank_in_place_falls_back_on_every_rank(saved_run, tmp_path):
    """Rank 0's choice reads no tensor: the flipped bit is found by the rank whose part holds it,
    while every rank reads in place; every rank then takes the previous checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    newest = checkpoint.latest(run)
    _flip(newest / "__1_0.distcp")
    p = run_train(run, *ARGS, DCP, ZERO, "train.max_steps=7", "train.resume=auto", nproc=2)
    out = p.stdout + p.stderr
    assert "checksum mismatch in __1_0.distcp" in out and "trying the previous checkpoint" in out, out[-3000:]
    assert f"resumed from {newest.with_name('ckpt_00000003')} at step 3" in out, out[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, 8))


@pytest.mark.slow
def test_tp2_folders_hold_each_ranks_slices_and_resume_bitwise(tmp_path):
    """mesh.tp=2 with ZeRO-1 on dp 2: each rank writes its own slices (a fused qkv weight: 3 parts
    x 2 tp ranks, never gathered), and the resumed run is the uninterrupted one, bit for bit."""
    from minddp.train.checkpoint.dcp_reader import SafeReader

    args = [*ARGS, DCP, ZERO, "mesh.tp=2"]
    run_train(tmp_path / "ref", *args, nproc=4)
    run_train(tmp_path / "run", *args, "train.stop_at_step=3", nproc=4)
    folder = checkpoint.latest(tmp_path / "run")
    entries = SafeReader(folder).read_metadata().state_dict_metadata
    qkv = next(k for k in entries if k.startswith("model/") and "qkv.weight" in k)
    assert len(entries[qkv].chunks) == 6, entries[qkv].chunks
    shutil.copytree(tmp_path / "run", tmp_path / "one")
    run_train(tmp_path / "run", *args, "train.resume=auto", nproc=4)
    _equal(final_model(tmp_path / "run"), final_model(tmp_path / "ref"))
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in metrics(tmp_path / "ref")]
    # the same slices and ZeRO-1 parts read whole by one process (tp 1, plain): the same run, to rounding
    run_train(tmp_path / "one", *ARGS, DCP, "train.resume=auto", nproc=1)
    assert_same_curves(metrics(tmp_path / "one"), metrics(tmp_path / "ref"), atol=1e-5)
    for k, v in final_model(tmp_path / "ref").items():
        torch.testing.assert_close(final_model(tmp_path / "one")[k], v, atol=3e-5, rtol=1e-4)
