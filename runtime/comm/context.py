"""`DistContext`: rank, world, and one process group per mesh axis, passed explicitly.

Nothing here is global: a context is an ordinary object that the executor,
the tensor-parallel modules and the gradient buckets receive. Two contexts
can live in one process (tests run several builds in one worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.comm import Communicator, Group
from runtime.program import axis_group, coords_of


@dataclass
class DistContext:
    """Where this process sits in the device mesh.

    Attributes:
        rank, world_size: global rank and number of processes.
        mesh: (axis, size) pairs, outermost first (pipe, data, tensor), row-major ranks.
        coords: this rank's coordinate on each axis.
        comm: the Communicator (torch.distributed or MPI).
        groups: this rank's group on each axis (size-1 axes get a trivial group).
        timeout: seconds any single communication may take.
    """

    rank: int
    world_size: int
    mesh: tuple[tuple[str, int], ...]
    coords: tuple[int, ...]
    comm: Communicator
    groups: dict[str, Group] = field(default_factory=dict)
    timeout: float = 300.0

    @classmethod
    def create(cls, comm: Communicator, mesh: dict[str, int] | tuple[tuple[str, int], ...],
               timeout: float = 300.0, derived_axes: tuple[str, ...] = ()) -> "DistContext":
        """Build this rank's axis groups (members only, in mesh order, so no rank waits on a cycle),
        then the groups of `derived_axes` (e.g. "pair", see runtime.program), in the order given:
        every rank passes the same axes, so members of a group create it at the same point."""
        mesh_t = tuple(mesh.items()) if isinstance(mesh, dict) else tuple(mesh)
        size = 1
        for _, s in mesh_t:
            size *= s
        if size != comm.world_size:
            raise ValueError(f"the mesh {dict(mesh_t)} needs {size} processes but {comm.world_size} were started")
        coords = coords_of(mesh_t, comm.rank)
        groups = {axis: comm.group(axis_group(mesh_t, coords, axis))
                  for axis in (*(a for a, _ in mesh_t), *derived_axes)}
        return cls(rank=comm.rank, world_size=comm.world_size, mesh=mesh_t, coords=coords, comm=comm,
                   groups=groups, timeout=timeout)

    @property
    def device(self) -> torch.device:
        return self.comm.device

    def coord(self, axis: str) -> int:
        return self.coords[[a for a, _ in self.mesh].index(axis)]

    def size(self, axis: str) -> int:
        return dict(self.mesh)[axis]

    def group(self, axis: str) -> Group:
        return self.groups[axis]
