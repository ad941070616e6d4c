"""Rank layout of a device mesh: which global rank sits at which coordinates, and which
ranks form a group along an axis.

A mesh is a sequence of (axis name, size) pairs, outermost first (runtime.vocab.MeshAxis
names them); ranks 0 .. prod(sizes) - 1 are laid out row-major with the LAST axis fastest,
so the innermost axis's groups are contiguous ranks. The runtime builds its communicator
groups from this layout (runtime/program/__init__.py) and the cost model prices collectives over the
same groups (cost_models/mesh_axes.py).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


class MeshError(ValueError):
    """A coordinate outside the mesh or an axis it does not have; the message names it."""


def rank_of(mesh: Iterable[tuple[str, int]], coords: Iterable[int]) -> int:
    """Global rank of `coords` on a row-major mesh (last axis fastest)."""
    rank = 0
    for (_, size), c in zip(mesh, coords):
        if not 0 <= c < size:
            raise MeshError(f"coordinate {c} is outside an axis of size {size}")
        rank = rank * size + c
    return rank


def coords_of(mesh: Iterable[tuple[str, int]], rank: int) -> tuple[int, ...]:
    """Coordinates of a global rank (inverse of rank_of)."""
    sizes = [s for _, s in mesh]
    out = []
    for s in reversed(sizes):
        out.append(rank % s)
        rank //= s
    return tuple(reversed(out))


def _axis_index(mesh: Sequence[tuple[str, int]], axis: str) -> int:
    names = [name for name, _ in mesh]
    if axis not in names:
        raise MeshError(f"unknown mesh axis {axis!r}; the mesh has axes {names}")
    return names.index(axis)


def group_along(mesh: Sequence[tuple[str, int]], coords: Sequence[int], axis: str) -> tuple[int, ...]:
    """Global ranks that differ from `coords` only on `axis`, in coordinate order."""
    k = _axis_index(mesh, axis)
    at = list(coords)
    out = []
    for c in range(mesh[k][1]):
        at[k] = c
        out.append(rank_of(mesh, at))
    return tuple(out)


def groups_along(mesh: Sequence[tuple[str, int]], axis: str) -> tuple[tuple[int, ...], ...]:
    """Every group along `axis` (each as :func:`group_along`), sorted by first rank.

    E.g. for pipeline 2 x data 2 x tensor 2: tensor ((0,1),(2,3),(4,5),(6,7)), data
    ((0,2),(1,3),(4,6),(5,7)), pipeline ((0,4),(1,5),(2,6),(3,7))."""
    k = _axis_index(mesh, axis)
    size = mesh[k][1]
    stride = math.prod(s for _, s in mesh[k + 1:])
    world = math.prod(s for _, s in mesh)
    block = stride * size  # ranks spanned by one full sweep of the axis
    return tuple(tuple(start + inner + j * stride for j in range(size))
                 for start in range(0, world, block) for inner in range(stride))
