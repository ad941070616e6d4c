"""Named mesh axes on a cluster: which ranks form each axis's groups (row-major, last axis
fastest, tensor innermost by default: runtime.vocab.default_mesh_order) and the time of a collective over
one axis.

The collective formulas themselves live in :mod:`cost_models.comm_formulas`, their choice in :mod:`cost_models.comm`.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping

from cost_models.comm import CollectiveCost, _check_op, _cheapest, _group_shape, _GroupShape, _measured, _scaled_links
from cost_models.comm_formulas import check_bytes
from cost_models.hardware import Cluster
from runtime.program.mesh import groups_along
from runtime.vocab import MeshAxis


# --- named mesh axes -----------------------------------------------------------------------


def _innermost(mesh: Mapping[str, int]) -> str:
    """The mesh's innermost (last, fastest-varying) axis: tensor in every ParallelConfig.mesh."""
    return next(reversed(list(mesh)))


def innermost(mesh: Mapping[str, int]) -> tuple[str, int]:
    """(name, size) of the mesh's innermost axis (tensor in every ParallelConfig.mesh, of size 1 included)."""
    axis = _innermost(mesh)
    return axis, mesh[axis]


def _lanes_and_inner(mesh: Mapping[str, int]) -> tuple[int, int]:
    """(data_lanes, the innermost axis's size), with one look at the mesh."""
    inner = _innermost(mesh)
    return math.prod(v for a, v in mesh.items() if a not in (MeshAxis.PIPELINE, inner)), mesh[inner]


def data_lanes(mesh: Mapping[str, int]) -> int:
    """Ranks per pipeline position and innermost coordinate: the data axis and every axis a mesh orders
    between pipeline and its innermost axis (spatial tiles, context chunks, sub-grids), which hold the same
    stage and fold into one data coordinate (ranks are row-major, pipeline outermost, tensor innermost)."""
    return _lanes_and_inner(mesh)[0]


def rank_coords(rank: int, mesh: Mapping[str, int]) -> tuple[int, int, int]:
    """(pipeline, data, innermost) coordinates of a rank; ranks are row-major over the mesh (pipeline first,
    the innermost axis, tensor, fastest). The axes between pipeline and the innermost one are folded into the
    data coordinate (data x spatial + spatial, for one: data_lanes)."""
    d, t = _lanes_and_inner(mesh)
    return rank // (d * t), (rank // t) % d, rank % t


def rank_at(pipe: int, data: int, inner: int, mesh: Mapping[str, int]) -> int:
    """The rank at (pipeline, data, innermost) coordinates (rank_coords' inverse)."""
    d, t = _lanes_and_inner(mesh)
    return (pipe * d + data) * t + inner


def lane_ranks(mesh: Mapping[str, int], positions) -> list[int]:
    """The ranks of every data lane (data_lanes) at the given pipeline positions, each at the first coordinate
    of the innermost (tensor) axis, sorted: the ranks that hold those stages' same shard."""
    return sorted({rank_at(pos, j, 0, mesh) for pos in positions for j in range(data_lanes(mesh))})


def _mesh_items(mesh: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    if not isinstance(mesh, Mapping):
        raise ValueError(f"mesh must be a mapping of axis name -> size, got {mesh!r}")
    items = tuple(mesh.items())
    for name, size in items:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have an integer size >= 1, got {size!r}")
    return items


@functools.lru_cache(maxsize=4096)
def _axis_groups(items: tuple[tuple[str, int], ...], axis: str) -> tuple[tuple[int, ...], ...]:
    return groups_along(items, axis)


def axis_groups(mesh: Mapping[str, int], axis: str) -> list[list[int]]:
    """The rank groups along ``axis`` of a device mesh.

    ``mesh`` maps axis names to sizes, outermost first; ranks ``0..prod(sizes)-1`` are
    laid out row-major with the LAST axis innermost (its groups are contiguous ranks), the
    runtime's layout (runtime/program/mesh.py).
    Each group holds the ranks that differ only in their ``axis`` coordinate, in
    coordinate order; groups are sorted by their first rank. E.g. for
    ``{"pipeline": 2, "data": 2, "tensor": 2}``: tensor ``[[0,1],[2,3],[4,5],[6,7]]``, data
    ``[[0,2],[1,3],[4,6],[5,7]]``, pipeline ``[[0,4],[1,5],[2,6],[3,7]]``.

    Raises ValueError for an unknown axis or a size that is not an integer >= 1.
    """
    return [list(group) for group in _axis_groups(_mesh_items(mesh), axis)]


@functools.lru_cache(maxsize=4096)
def _axis_shapes(
    items: tuple[tuple[str, int], ...], axis: str, devices_per_node: int, neighbours: bool
) -> tuple[_GroupShape, ...]:
    """The distinct shapes of the axis's groups (or of adjacent pairs in them)."""
    world = math.prod(s for _, s in items)
    shapes: dict[_GroupShape, None] = {}
    for group in _axis_groups(items, axis):
        if neighbours and len(group) > 1:
            parts = [group[j : j + 2] for j in range(len(group) - 1)]
        else:
            parts = [group]
        for part in parts:
            shapes.setdefault(_group_shape(devices_per_node, world, part), None)
    return tuple(shapes)


def axis_spans_nodes(mesh: Mapping[str, int], axis: str, devices_per_node: int) -> bool:
    """Whether a group of ``axis`` of ``mesh`` spans nodes of ``devices_per_node`` devices (so its
    collectives run on the inter-node link, else on the intra-node one). False for an axis of size 1."""
    return any(shape.spans_nodes for shape in _axis_shapes(_mesh_items(mesh), axis, devices_per_node, False))


def axis_collective_time(
    cluster: Cluster,
    mesh: Mapping[str, int],
    axis: str,
    op: str,
    nbytes: float,
    efficiency: Mapping[str, float] | None = None,
) -> CollectiveCost:
    """Cost of ``op`` run along ``axis`` of ``mesh`` on ``cluster``, in seconds.

    Every group of the axis (:func:`axis_groups`) runs the collective at once; the
    result is the cost on the slowest group. For ``op == "p2p"`` it is the slowest
    transfer between two ranks adjacent along the axis (neighbouring pipeline stages);
    for an axis of size 1, 0. Arguments as in :func:`collective_time`.

    Raises ValueError if the mesh's size differs from ``cluster.num_devices`` (naming
    both), for an unknown axis, and as :func:`collective_time` does.
    """
    _check_op(op)
    check_bytes(nbytes)
    items = _mesh_items(mesh)
    world = math.prod(s for _, s in items)
    if world != cluster.num_devices:
        sizes = " x ".join(f"{name}={size}" for name, size in items)
        raise ValueError(
            f"mesh {sizes} has {world} ranks but cluster {cluster.name!r} has "
            f"{cluster.num_devices} devices; the axis sizes must multiply to the device count"
        )
    worst: CollectiveCost | None = None
    for shape in _axis_shapes(items, axis, cluster.devices_per_node, op == "p2p"):
        cost = _measured(cluster, op, nbytes, shape, efficiency) or \
            _cheapest(op, nbytes, shape, *_scaled_links(cluster, shape, efficiency))
        if worst is None or cost.seconds > worst.seconds:
            worst = cost
    assert worst is not None  # an axis always has at least one group
    return worst
