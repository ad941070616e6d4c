"""The DeviceMesh of a torch layout: built from the layout's dimensions, or a given one checked."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class MeshMismatch(ValueError):
    """A given DeviceMesh or the process group does not match the layout; the message says how."""


def mesh_dims(layout: dict) -> tuple[tuple[str, int], ...]:
    """(axis name, size) of every mesh dimension of a layout dict, outermost first."""
    return tuple((str(a), int(n)) for a, n in layout["mesh"])


def build_mesh(layout: dict, device_type: str) -> DeviceMesh:
    """A DeviceMesh with the layout's dimensions and names over the initialized default process group
    (ranks row-major, the last dimension fastest, as meshplan lays them out)."""
    dims = mesh_dims(layout)
    check_world(dims)
    return init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(a for a, _ in dims))


def check_world(dims: tuple[tuple[str, int], ...]) -> None:
    """MeshMismatch unless a process group is initialized with as many ranks as the mesh has."""
    want = 1
    for _, n in dims:
        want *= n
    if not dist.is_available() or not dist.is_initialized():
        raise MeshMismatch(f"no process group is initialized; call torch.distributed.init_process_group() in each "
                           f"of the plan's {want} processes (torchrun starts them) before applying the plan")
    if dist.get_world_size() != want:
        raise MeshMismatch(f"the plan runs on {want} devices ({' x '.join(f'{a} {n}' for a, n in dims)}) but the "
                           f"process group has {dist.get_world_size()} ranks; launch {want} processes")


def check_mesh(mesh: DeviceMesh, layout: dict) -> DeviceMesh:
    """`mesh` itself if it has the layout's dimension names and sizes in order; MeshMismatch otherwise."""
    dims = mesh_dims(layout)
    check_world(dims)
    have = tuple(zip(mesh.mesh_dim_names or (), mesh.mesh.shape))
    if have != dims:
        raise MeshMismatch(f"the given DeviceMesh has dimensions {list(have)} but the plan needs {list(dims)} "
                           f"(names and sizes, outermost first); pass mesh=None to build it from the plan")
    return mesh
