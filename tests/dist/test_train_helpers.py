"""The trainer's helpers on their own, with the arguments they take (never a Trainer): fail
together on every rank, the training state saved and loaded, the skipped-steps guard. Each on 2
forked gloo ranks."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from minddp.errors import ConfigError
from minddp.parallel.mesh import Mesh
from minddp.train.checkpoint import CheckpointError, CheckpointReadError
from minddp.train.checkpoint import load as load_checkpoint
from minddp.train.checkpoint.state import RunState
from minddp.train.data import ArithmeticSequences, ShardedBatches
from minddp.train.safety.guard import DivergedError, SkipGuard
from minddp.train.safety.together import together
from minddp.train.trainer import lr_factor
from tests import launch
from tests.training_state import CPU, outcome, save_state, setup, train


# ------------------------------------------------------------------ fail together
def _together(rank, world, failing, error, kw):
    return outcome(lambda: together(error if rank in failing else None, value=10 * rank, **kw))


def test_no_failure_gives_every_ranks_value_on_every_rank():
    assert launch.ranks(_together, 2, (), None, {}) == [("ok", [0, 10])] * 2


def test_a_config_error_on_one_rank_is_the_same_line_on_every_rank_naming_it():
    got = launch.ranks(_together, 2, (1,), ConfigError("data.dir is empty"), {})
    assert got == [("ConfigError", "on rank 1 (1 of 2 ranks failed): data.dir is empty")] * 2


def test_the_same_error_on_every_rank_names_no_rank():
    assert launch.ranks(_together, 2, (0, 1), ConfigError("bad"), {}) == [("ConfigError", "bad")] * 2


def test_another_error_is_its_own_on_the_failing_rank_and_named_on_the_others():
    got = launch.ranks(_together, 2, (1,), ValueError("torn file"), {})
    assert got[1] == ("ValueError", "torn file")
    assert got[0] == ("RuntimeError", "ValueError: on rank 1 (1 of 2 ranks failed): torn file")


@pytest.mark.parametrize("error,kind", [(CheckpointError("ckpt_2.pt is corrupt"), "CheckpointError"),
                                        (OSError(5, "Input/output error"), "CheckpointReadError")])
def test_with_an_action_the_others_say_which_rank_could_not_do_it(error, kind):
    kw = {"what": "resume", "kinds": (CheckpointError, CheckpointReadError)}
    got = launch.ranks(_together, 2, (0,), error, kw)
    assert got[0] == (type(error).__name__, str(error))
    assert got[1] == (kind, f"rank 0 could not resume: {type(error).__name__}: {error}")


def test_one_process_raises_its_own_error_without_a_collective():
    assert together(None, 3) == [3]
    with pytest.raises(KeyError):
        together(KeyError("x"), 3)


# ------------------------------------------------------------------ training state
def _save_then_load(rank, world, run_dir, folder, shard):
    mesh = Mesh.create(world, 1, "cpu")
    batches = ShardedBatches(ArithmeticSequences(64, 8, 16), mesh.dp_size, mesh.dp_rank, 2, 1, 0, CPU)
    model, ddp, opt, sched, factor = setup(0, shard=shard)
    train(model, ddp, opt, sched, batches, (1, 2, 3))
    save_state(run_dir, 3, model=model, opt=opt, sched=sched, batches=batches, mesh=mesh, device=CPU,
               saved_with={"config": {"note": "mine"}}, folder=folder, log=lambda line: None)
    train(model, ddp, opt, sched, batches, (4,))
    after = {k: v.clone() for k, v in model.state_dict().items()}
    saved = load_checkpoint(f"{run_dir}/checkpoints/ckpt_00000003{'' if folder else '.pt'}", "cpu")
    model2, ddp2, opt2, sched2, factor2 = setup(1, shard=shard)  # other weights, a fresh schedule
    pieces = RunState(model2, opt2, sched2, batches, mesh, CPU, factor2)
    start = pieces.load_state_dict(saved, "ckpt_00000003.pt")
    lr = opt2.optim.param_groups[0]["lr"]
    train(model2, ddp2, opt2, sched2, batches, (4,))
    return start, saved["samples_seen"], saved["config"], lr, after, model2.state_dict()


@pytest.mark.parametrize("folder, shard", [(False, False), (True, False), (True, True), (False, True)],
                         ids=["file", "folder", "folder-zero1", "file-zero1"])
def test_a_saved_state_loads_into_a_fresh_model_and_continues_exactly(tmp_path, folder, shard):
    """A file (rank 0 writes what was gathered) or a folder (each rank writes its own part; with
    ZeRO-1 its shard of the optimizer state): step 4 after the load is step 4 of the saver."""
    got = launch.ranks(_save_then_load, 2, tmp_path, folder, shard)
    if folder:  # what each rank wrote: with ZeRO-1 the parts of the state tensors, never gathered
        keys = FileSystemReader(tmp_path / "checkpoints/ckpt_00000003").read_metadata().state_dict_metadata
        chunks = {k: len(m.chunks) for k, m in keys.items() if k.startswith("optimizer/")}
        assert chunks and any(n > 1 for n in chunks.values()) == shard, chunks  # ZeRO-1: each rank's part
    for rank, (start, seen, config, lr, after, resumed) in enumerate(got):
        assert (start, seen, config) == (3, 3 * 2 * 2, {"note": "mine"}), rank
        assert lr == pytest.approx(1e-2 * lr_factor(3, SimpleNamespace(
            lr=1e-2, warmup_steps=2, min_lr=1e-3), 20))  # this run's schedule, at the saved position
        for k in after:  # step 4 after the load equals step 4 of the run that saved
            torch.testing.assert_close(resumed[k], after[k], atol=0, rtol=0)


def _save_fails_on_rank_0(rank, world, run_dir, folder):
    mesh = Mesh.create(world, 1, "cpu")
    batches = ShardedBatches(ArithmeticSequences(64, 8, 16), mesh.dp_size, mesh.dp_rank, 2, 1, 0, CPU)
    model, ddp, opt, sched, _ = setup(0)
    return outcome(lambda: save_state(run_dir, 3, model=model, opt=opt, sched=sched, batches=batches,
                                       mesh=mesh, device=CPU, saved_with={}, folder=folder))


@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_a_checkpoint_rank_0_cannot_write_stops_every_rank(tmp_path, folder):
    (tmp_path / "checkpoints").write_text("a file where the folder goes")
    got = launch.ranks(_save_fails_on_rank_0, 2, tmp_path, folder)
    assert got[0][0] == "CheckpointWriteError" and "could not write checkpoint" in got[0][1], got
    assert got[1][0] == "CheckpointWriteError", got
    assert got[1][1].startswith("rank 0 could not save step 3: CheckpointWriteError: could not write"), got


# ------------------------------------------------------------------ skipped-steps guard
def _guard(rank, world, nan, start, path):
    model, ddp, opt, _, _ = setup(0)
    if nan:
        with torch.no_grad():
            model[1].weight[0, 0] = math.nan
    guard = SkipGuard(2, 3e-4, torch.device("cpu"), start, path)
    guard.after_step(start + 1, True, model, opt)
    guard.after_step(start + 2, False, model, opt)  # a good step resets the count
    guard.after_step(start + 3, True, model, opt)
    return outcome(lambda: guard.after_step(start + 4, True, model, opt))


def test_the_guard_stops_every_rank_blaming_the_learning_rate_when_the_weights_are_finite():
    for kind, text in launch.ranks(_guard, 2, False, 0, None):
        assert kind == DivergedError.__name__, text
        assert text.startswith("2 steps in a row (3..4) had a non-finite loss"), text
        assert "optim.lr=0.0003 is likely too high" in text, text


def _guard_resumed(rank, world, path):
    model, ddp, opt, _, _ = setup(0)
    with torch.no_grad():
        model[1].weight[0, 0] = math.nan  # as loaded from the checkpoint, on every rank
    guard = SkipGuard(2, 3e-4, torch.device("cpu"), 6, path)
    guard.after_step(7, True, model, opt)
    return outcome(lambda: guard.after_step(8, True, model, opt))


def test_the_guard_names_the_checkpoint_a_run_resumed_from_when_its_weights_are_nan():
    for kind, text in launch.ranks(_guard_resumed, 2, "run/checkpoints/ckpt_00000006.pt"):
        assert kind == DivergedError.__name__, text
        assert "the weights are NaN/inf, from the checkpoint this run resumed from, " \
               "run/checkpoints/ckpt_00000006.pt" in text, text



def _background_save_whose_staging_fails_on_rank_1(rank, world, run_dir):
    from minddp.train.checkpoint import folders

    mesh = Mesh.create(world, 1, "cpu")
    batches = ShardedBatches(ArithmeticSequences(64, 8, 16), mesh.dp_size, mesh.dp_rank, 2, 1, 0, CPU)
    model, ddp, opt, sched, _ = setup(0, shard=True)
    train(model, ddp, opt, sched, batches, (1,))
    if rank == 1:  # its host copy fails (out of host memory): rank 0 must not start writing alone
        def no_memory(tensors):
            raise MemoryError("host out of memory")
        folders.stage = no_memory
    return outcome(lambda: save_state(run_dir, 1, model=model, opt=opt, sched=sched, batches=batches,
                                      mesh=mesh, device=CPU, saved_with={}, folder=True, background=True))


def test_a_background_save_that_one_rank_cannot_stage_stops_every_rank_without_a_leftover(tmp_path):
    got = launch.ranks(_background_save_whose_staging_fails_on_rank_1, 2, tmp_path, timeout=60)
    assert got[1] == ("MemoryError", "host out of memory"), got
    assert got[0] == ("CheckpointWriteError", "rank 1 could not save step 1: MemoryError: host out of memory")
    assert list((tmp_path / "checkpoints").iterdir()) == []  # rank 0 removed the temporary folder
