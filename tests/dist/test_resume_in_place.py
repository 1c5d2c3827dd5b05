"""A folder checkpoint read in place (issue 55.1): each rank reads only the stored items its own
tensors overlap, into the model and optimizer it trains, and the run goes on bit for bit as if
never stopped; ZeRO-1's parts move to the ranks that step them after the engine's rebuild."""

import json

import pytest
import torch

from minddp.parallel.mesh import Mesh
from minddp.train import checkpoint
from minddp.train.checkpoint import resolve_agreed
from minddp.train.checkpoint.dcp_reader import SafeReader
from minddp.train.checkpoint.state import RunState
from minddp.train.data import ArithmeticSequences, ShardedBatches
from tests import launch
from tests.training_state import CPU, save_state, setup, train


def _stopped_and_resumed(rank, world, run_dir, shard, save_world):
    import torch.distributed as dist

    mesh = Mesh.create(world, 1, "cpu")
    batches = ShardedBatches(ArithmeticSequences(64, 8, 16), mesh.dp_size, mesh.dp_rank, 2, 1, 0, CPU)
    model, ddp, opt, sched, factor = setup(0, shard=shard)
    train(model, ddp, opt, sched, batches, (1, 2, 3))
    if world == save_world:
        save_state(run_dir, 3, model=model, opt=opt, sched=sched, batches=batches, mesh=mesh, device=CPU,
                   saved_with={}, folder=True)
    dist.barrier()
    train(model, ddp, opt, sched, batches, (4, 5))
    want = {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()

    model2, ddp2, opt2, sched2, _ = setup(1, shard=shard)  # another start: everything must come back
    read, pieces = [], RunState(model2, opt2, sched2, batches, mesh, CPU, factor)
    path, saved = resolve_agreed(run_dir, "auto", CPU,
                                 into=lambda p, s: read.append(pieces.read_in_place(p, s)))
    start = pieces.load_state_dict(saved, path)
    train(model2, ddp2, opt2, sched2, batches, range(start + 1, 6))
    got = model2.state_dict(), opt2.state_dict()
    for k, v in want[0].items():
        torch.testing.assert_close(got[0][k], v, atol=0, rtol=0)
    for i, st in want[1]["state"].items():
        for key, v in st.items():
            torch.testing.assert_close(got[1]["state"][i][key], v, atol=0, rtol=0)
    return start, read[0]


@pytest.mark.parametrize("shard", [True, False], ids=["zero1", "plain"])
def test_a_folder_read_in_place_resumes_bitwise_each_rank_reading_its_part(tmp_path, shard):
    got = launch.ranks(_stopped_and_resumed, 2, tmp_path, shard, 2)
    assert [start for start, _ in got] == [3, 3]
    folder = tmp_path / "checkpoints" / "ckpt_00000003"
    chunks = json.loads((folder / "integrity.json").read_text())["chunks"]
    stored = sum(n for _, _, n, _ in chunks)
    index = SafeReader(folder).read_metadata()
    replicated = sum(info.length for i, info in index.storage_data.items()  # held whole by every rank
                     if i.fqn.startswith("model/") or (i.fqn.startswith("optimizer/") and not shard))
    for _, read in got:  # what is replicated, every rank reads; the rest is split
        assert replicated <= read <= 1.2 * (stored - replicated) / 2 + replicated, (read, stored, replicated)


def _saved(rank, world, run_dir):
    mesh = Mesh.create(world, 1, "cpu")
    batches = ShardedBatches(ArithmeticSequences(64, 8, 16), mesh.dp_size, mesh.dp_rank, 2, 1, 0, CPU)
    model, ddp, opt, sched, _ = setup(0, shard=True)
    train(model, ddp, opt, sched, batches, (1, 2, 3))
    save_state(run_dir, 3, model=model, opt=opt, sched=sched, batches=batches, mesh=mesh, device=CPU,
               saved_with={}, folder=True)


def _in_place_against_whole(rank, world, run_dir):
    """The same checkpoint read in place, and whole (a file's way), then two steps: equal."""
    mesh = Mesh.create(world, 1, "cpu")
    batches = ShardedBatches(ArithmeticSequences(64, 8, 16), mesh.dp_size, mesh.dp_rank, 2, 1, 0, CPU)
    runs = []
    for seed, whole in ((1, False), (2, True)):
        model, ddp, opt, sched, factor = setup(seed, shard=True)
        pieces = RunState(model, opt, sched, batches, mesh, CPU, factor)
        if whole:
            path = checkpoint.latest(run_dir)
            saved = checkpoint.load(path, CPU)
        else:
            path, saved = resolve_agreed(run_dir, "auto", CPU, into=pieces.read_in_place)
        start = pieces.load_state_dict(saved, path)
        train(model, ddp, opt, sched, batches, (start + 1, start + 2))
        runs.append((model.state_dict(), opt.state_dict()))
    (m1, o1), (m2, o2) = runs
    for k, v in m2.items():
        torch.testing.assert_close(m1[k], v, atol=0, rtol=0)
    for i, st in o2["state"].items():
        for key, v in st.items():
            torch.testing.assert_close(o1["state"][i][key], v, atol=0, rtol=0)


@pytest.mark.parametrize("saved_on,resumed_on", [(2, 3), (3, 2), (2, 1)])
def test_zero1_parts_saved_at_one_dp_are_read_in_place_at_another(tmp_path, saved_on, resumed_on):
    launch.ranks(_saved, saved_on, tmp_path)
    launch.ranks(_in_place_against_whole, resumed_on, tmp_path)
