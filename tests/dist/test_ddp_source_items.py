"""minddp.DDP and torch DDP on the same two-rank scripts, for what torch's source-tree DDP tests
(test_c10d_common.py / test_c10d_gloo.py, tests/dist/test_torch_ddp_source_suite.py) found:
torch's logger read (`_get_ddp_logging_data()`), a comm hook that returns no future, and a
ShardedTensor parameter left out with `_set_params_and_buffers_to_ignore_for_model`."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

import minddp
from tests import launch
from tests.models import MLP, WithBN, batch, shard

TORCH_DDP = nn.parallel.DistributedDataParallel
WRAPPERS = (minddp.DDP, TORCH_DDP)


# ------------------------------------------------------------ torch's logger read
# the fields minddp gives that must read as torch's (minddp's own differ on purpose: docs/torch_ddp_tests.md)
SAME_AS_TORCH = ("world_size", "rank", "backend_name", "module_name", "device_ids", "output_device",
                 "is_multi_device_module", "has_sync_bn", "broadcast_buffers", "bucket_cap_bytes",
                 "find_unused_parameters", "static_graph", "gradient_as_bucket_view", "dtypes",
                 "num_parameter_tensors", "total_parameter_size_bytes", "iteration", "bucket_sizes",
                 "comm_hook", "join_uneven_inputs")
OPTIONS = [dict(), dict(find_unused_parameters=True, gradient_as_bucket_view=True),
           dict(static_graph=True, bucket_cap_mb=1.5, broadcast_buffers=False)]


def _logging_data(rank, world_size, options, hook):
    out = []
    for cls in WRAPPERS:
        torch.manual_seed(0)
        model = cls(WithBN(), **options)
        before = model._get_ddp_logging_data()  # right after construction, as torch's tests read it
        if hook:
            model.register_comm_hook(None, _allreduce_hook)
        for step in range(3):
            x, y = batch(step, world_size)
            nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
        after = model._get_ddp_logging_data()
        out.append([{k: d.get(k) for k in SAME_AS_TORCH} for d in (before, after)])
    return out


def _allreduce_hook(state, bucket):
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])  # torch's hooks give the tensor back


@pytest.mark.parametrize("options", OPTIONS, ids=["default", "find_unused+view", "static+cap+no_bcast"])
def test_logging_data_reads_as_torchs(options):
    for rank, (ours, torchs) in enumerate(launch.ranks(_logging_data, 2, options, False)):
        assert ours == torchs, f"rank {rank}"
        assert ours[1]["iteration"] == 2 and ours[0]["rank"] == rank  # torch: 3 iterations, 2 logged


def test_logging_data_names_the_comm_hook():
    for ours, torchs in launch.ranks(_logging_data, 2, {}, True):
        assert ours == torchs
        assert ours[1]["comm_hook"] == "_allreduce_hook"


def _logged_error(rank, world_size):
    out = []
    for cls in WRAPPERS:
        model = cls(MLP())
        data = model._get_ddp_logging_data()
        assert data.get("has_error") in (0, None) and "error" not in data

        def hook(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
            return torch.futures.Future()

        with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket") as e:
            model.register_comm_hook(None, hook)
        data = model._get_ddp_logging_data()
        assert data["has_error"] == 1 and str(e.value) in data["error"], (cls, data)
        out.append(str(e.value))
    return out


def test_logging_data_records_a_refused_comm_hook():
    for ours, torchs in launch.ranks(_logged_error, 2):
        assert ours == torchs


# ----------------------------------------------- a comm hook that returns no future
def _hook_returns_no_future(rank, world_size):
    texts = []
    for cls in WRAPPERS:
        model = cls(MLP())
        model.register_comm_hook(None, lambda state, bucket: 1)
        x, y = batch(0, world_size)
        with pytest.raises(RuntimeError) as e:
            nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
        texts.append(str(e.value))
    return texts


def test_a_comm_hook_that_returns_no_future_raises_torchs_error():
    for ours, torchs in launch.ranks(_hook_returns_no_future, 2):
        expected = "callback must return a torch.futures.Future object, but got builtins.int"
        assert expected in ours and expected in torchs.replace(" or torch._C.Future", ""), (ours, torchs)


# ------------------------------------- an ignored ShardedTensor parameter is never touched
class WithShardedTensor(nn.Module):
    """torch's test_ignored_sharded_tensor model: a trained layer beside a ShardedTensor parameter
    that DDP leaves out (each rank holds its own shard)."""

    def __init__(self, rank, world_size):
        super().__init__()
        self.fc1 = nn.Linear(8, 4)
        meta = ShardMetadata(shard_offsets=[rank * 5, 0], shard_sizes=[5, 10], placement=f"rank:{rank}/cpu")
        local = torch.full((5, 10), float(rank + 1))
        self.st = nn.Parameter(init_from_local_shards([Shard(local, meta)], [5 * world_size, 10]))

    def forward(self, x):
        return self.fc1(x)


def _ignored_sharded_tensor(rank, world_size):
    runs = []
    for cls in WRAPPERS:
        torch.manual_seed(rank)  # different replicas: the init broadcast must make them equal
        model = WithShardedTensor(rank, world_size)
        cls._set_params_and_buffers_to_ignore_for_model(model, {"st"})
        ddp = cls(model, gradient_as_bucket_view=True, broadcast_buffers=False, static_graph=True)
        opt = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(step, world_size)
            nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
            opt.step()
            opt.zero_grad()
        shard_values = model.st.local_shards()[0].tensor
        assert torch.equal(shard_values, torch.full((5, 10), float(rank + 1)))  # this rank's own
        runs.append({n: p.detach().clone() for n, p in model.fc1.named_parameters()})
    return runs


def test_an_ignored_sharded_tensor_parameter_is_never_touched():
    results = launch.ranks(_ignored_sharded_tensor, 2)
    for ours, torchs in results:
        for n in torchs:
            torch.testing.assert_close(ours[n], torchs[n], msg=n)
    for n in results[0][0]:  # the others trained as one replica
        assert torch.equal(results[0][0][n], results[1][0][n])
