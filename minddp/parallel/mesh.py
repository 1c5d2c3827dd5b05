"""Parallel dimensions -> a (dp, tp) DeviceMesh.

`ParallelDims` is pure: it validates the layout and computes rank groups
without processes, so the layout is unit-tested in milliseconds. `build()`
turns it into a DeviceMesh with tp innermost (tensor-parallel ranks are
contiguous and so share a node): for 8 ranks and tp=4, tp groups [0,1,2,3] and
[4,5,6,7], dp groups [0,4], [1,5], [2,6], [3,7].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tp: int = 1

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"mesh.tp must be >= 1, got tp={self.tp}")
        if self.world_size % self.tp:
            raise ValueError(
                f"mesh.tp={self.tp} does not divide the world size {self.world_size}: "
                f"need dp x tp = world size (dp = {self.world_size}/{self.tp} is not an integer). "
                f"Choose tp among the divisors of {self.world_size} or change the number of processes."
            )

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp rank, tp rank) of a global rank."""
        return divmod(rank, self.tp)

    def tp_groups(self) -> list[list[int]]:
        return [list(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [list(range(t, self.world_size, self.tp)) for t in range(self.tp)]

    def check_divides(self, **sizes: int) -> None:
        """E.g. check_divides(n_head=4, hidden=512): tp must divide each."""
        bad = {k: v for k, v in sizes.items() if v % self.tp}
        if bad:
            raise ValueError(
                f"mesh.tp={self.tp} must divide "
                + ", ".join(f"{k}={v}" for k, v in bad.items())
                + "; pick a tp that divides them or change the model size"
            )

    def build(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))


@dataclass
class Mesh:
    """The built mesh plus this rank's coordinates: the trainer never does rank arithmetic."""

    dims: ParallelDims
    device_mesh: DeviceMesh

    @classmethod
    def create(cls, world_size: int, tp: int, device_type: str) -> "Mesh":
        dims = ParallelDims(world_size, tp)
        return cls(dims, dims.build(device_type))

    @property
    def dp_group(self):
        return self.device_mesh["dp"].get_group()

    @property
    def tp_group(self):
        return self.device_mesh["tp"].get_group()

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(dist.get_rank())[0]

    @property
    def tp_rank(self) -> int:
        return self.dims.coords(dist.get_rank())[1]

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def tp_size(self) -> int:
        return self.dims.tp
