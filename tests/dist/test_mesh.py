"""The (dp, tp) layout: pure rules for 8 ranks, and a real 4-process DeviceMesh."""


import pytest
import torch.distributed as dist

from minddp.parallel.mesh import Mesh, ParallelDims
from tests import launch


@pytest.mark.parametrize("tp,tp_groups,dp_groups", [
    (1, [[0], [1], [2], [3], [4], [5], [6], [7]], [[0, 1, 2, 3, 4, 5, 6, 7]]),
    (2, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
    (4, [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (8, [[0, 1, 2, 3, 4, 5, 6, 7]], [[0], [1], [2], [3], [4], [5], [6], [7]]),
])
def test_layout_of_8_ranks(tp, tp_groups, dp_groups):
    dims = ParallelDims(8, tp)
    assert dims.tp_groups() == tp_groups and dims.dp_groups() == dp_groups
    assert dims.dp * dims.tp == 8 and dims.tp_enabled == (tp > 1) and dims.dp_enabled == (tp < 8)
    for rank in range(8):
        d, t = dims.coords(rank)
        assert rank in tp_groups[d] and rank in dp_groups[t]


def test_bad_layouts_name_every_factor():
    with pytest.raises(ValueError, match=r"mesh.tp=2 does not divide the world size 3"):
        ParallelDims(3, 2)
    with pytest.raises(ValueError, match="mesh.tp must be >= 1"):
        ParallelDims(4, 0)
    with pytest.raises(ValueError, match=r"mesh.tp=4 must divide n_head=6"):
        ParallelDims(8, 4).check_divides(n_head=6, hidden=512)


def _real_mesh(rank, world_size):
    mesh = Mesh.create(world_size, 2, "cpu")
    dims = mesh.dims
    d, t = dims.coords(rank)
    assert (mesh.dp_rank, mesh.tp_rank, mesh.dp_size, mesh.tp_size) == (d, t, 2, 2)
    assert dist.get_process_group_ranks(mesh.tp_group) == dims.tp_groups()[d]
    assert dist.get_process_group_ranks(mesh.dp_group) == dims.dp_groups()[t]
    return dist.get_process_group_ranks(mesh.tp_group), dist.get_process_group_ranks(mesh.dp_group)


def test_real_device_mesh_dp2_tp2():
    got = launch.ranks(_real_mesh, 4)
    assert got == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
