"""The geometry of spatial parallelism, with no tensors: how an image is cut into tiles, which halo
rows a window op (conv, pool) needs from its neighbours, where a rank's tile sits, and the
SpatialSpec a stage records. The cost model prices halos with it and codegen checks a layer's
halos at build time; runtime/parallel/spatial/halo.py and tile_ops.py run the halo exchange and the tile ops
(see their docstrings for the rules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from runtime.parallel.spatial.part import SpatialTiles
from runtime.vocab import SpatialBatchNorm, SpatialSplit


class SpatialError(ValueError):
    """A layer or image that cannot be split as asked; the message names the layer and what to change."""


def check_batchnorm(mode: str) -> None:
    if mode not in tuple(SpatialBatchNorm):
        raise SpatialError(f"batchnorm mode {mode!r} is not one of {', '.join(SpatialBatchNorm)}")

# ---------------------------------------------------------------------------
# geometry (pure functions)


def tile_shape(split: str, degree: int) -> tuple[int, int]:
    """(tiles along H, tiles along W) for `degree` tiles of kind `split`.

    A grid is the most square rows x cols = degree with rows <= cols (2x2 for 4, 2x4 for 8).
    """
    if split not in tuple(SpatialSplit):
        raise SpatialError(f"spatial split {split!r} is not one of {', '.join(SpatialSplit)}")
    if not isinstance(degree, int) or degree < 1:
        raise SpatialError(f"spatial degree must be a positive integer, got {degree!r}")
    if split == SpatialSplit.STRIPS_H:
        return degree, 1
    if split == SpatialSplit.STRIPS_V:
        return 1, degree
    rows = max(r for r in range(1, math.isqrt(degree) + 1) if degree % r == 0)
    return rows, degree // rows


def bounds(n: int, parts: int) -> list[int]:
    """Canonical tile boundaries of n rows over `parts` tiles: [0, ..., n] (parts + 1 entries)."""
    return [i * n // parts for i in range(parts + 1)]


@dataclass(frozen=True)
class Window:
    """One axis of a window op: kernel, stride, dilation and leading padding (rows)."""

    kernel: int
    stride: int = 1
    dilation: int = 1
    padding: int = 0

    @property
    def span(self) -> int:
        """Input rows one output row reads."""
        return self.dilation * (self.kernel - 1) + 1


@dataclass(frozen=True)
class AxisHalo:
    """What one tile does along one axis for one window op (all counts in rows).

    pad_lo/pad_hi: rows of the op's padding (image border) before/after;
    recv_lo/recv_hi: halo rows received from the previous/next tile;
    crop_lo/crop_hi: own rows the op does not read (dropped);
    send_lo/send_hi: own rows the previous/next tile needs (its halo), taken from
    this tile's start/end.
    """

    pad_lo: int
    recv_lo: int
    crop_lo: int
    crop_hi: int
    recv_hi: int
    pad_hi: int
    send_lo: int
    send_hi: int

    @property
    def exchanges(self) -> bool:
        return bool(self.recv_lo or self.recv_hi or self.send_lo or self.send_hi)


def _need(c: int, e: int, w: Window) -> tuple[int, int]:
    """Input rows [lo, hi) that output rows [c, e) read."""
    return c * w.stride - w.padding, (e - 1) * w.stride - w.padding + w.span


def axis_halos(n_in: int, n_out: int, parts: int, w: Window, *, layer: str = "layer") -> list[AxisHalo]:
    """Per tile (in order) the halo plan of one window op along one axis.

    Raises SpatialError naming `layer` when a tile would be empty or would need
    rows beyond its immediate neighbour (tiles thinner than the halo).
    """
    if parts == 1:
        lo, hi = _need(0, n_out, w)
        return [AxisHalo(max(0, -lo), 0, max(0, lo), max(0, n_in - hi), 0, max(0, hi - n_in), 0, 0)]
    a, c = bounds(n_in, parts), bounds(n_out, parts)
    for name, b, n in (("input", a, n_in), ("output", c, n_out)):
        if any(b[i + 1] == b[i] for i in range(parts)):
            raise SpatialError(f"{layer}: its {name} has {n} rows along a split axis, fewer than the {parts} "
                               f"tiles; use fewer tiles or end the spatial part before {layer}")
    need = [_need(c[i], c[i + 1], w) for i in range(parts)]
    out = []
    for i in range(parts):
        lo, hi = need[i]
        mine_lo, mine_hi = a[i], a[i + 1]
        pad_lo = max(0, -lo)
        recv_lo = max(0, mine_lo - max(lo, 0))
        crop_lo = max(0, lo - mine_lo)
        pad_hi = max(0, hi - n_in)
        recv_hi = max(0, min(hi, n_in) - mine_hi)
        crop_hi = max(0, mine_hi - hi)
        if recv_lo and max(lo, 0) < a[i - 1]:
            raise SpatialError(f"{layer}: tile {i} needs {recv_lo} halo rows but its neighbour holds only "
                               f"{a[i] - a[i - 1]}; use fewer tiles or end the spatial part before {layer}")
        if recv_hi and min(hi, n_in) > a[i + 2]:
            raise SpatialError(f"{layer}: tile {i} needs {recv_hi} halo rows but its neighbour holds only "
                               f"{a[i + 2] - a[i + 1]}; use fewer tiles or end the spatial part before {layer}")
        if crop_lo + crop_hi > mine_hi - mine_lo:
            raise SpatialError(f"{layer}: tile {i} reads none of its own rows; use fewer tiles")
        send_lo = max(0, min(need[i - 1][1], n_in) - mine_lo) if i > 0 else 0
        send_hi = max(0, mine_hi - max(need[i + 1][0], 0)) if i + 1 < parts else 0
        out.append(AxisHalo(pad_lo, recv_lo, crop_lo, crop_hi, recv_hi, pad_hi, send_lo, send_hi))
    return out


def halo_widths(kernel: int, stride: int = 1, dilation: int = 1, padding: int | None = None) -> tuple[int, int]:
    """(rows before, rows after) an interior tile receives for a window op, with tiles aligned to the
    stride and the canonical output partition: padding and span - stride - padding (at least 0).

    3x3 stride 1 pad 1 -> (1, 1); 5x5 pad 2 -> (2, 2); 1x1 -> (0, 0); 3x3 stride 2 pad 1 -> (1, 0).
    """
    p = (dilation * (kernel - 1)) // 2 if padding is None else padding
    span = dilation * (kernel - 1) + 1
    return p, max(0, span - stride - p)


# ---------------------------------------------------------------------------
# the tile layout of one spatial group


@dataclass(frozen=True)
class TileLayout:
    """Where this rank's tile sits: grid (rows, cols), position (i, j), and the group's global ranks
    in row-major tile order."""

    rows: int
    cols: int
    i: int
    j: int
    ranks: tuple[int, ...]

    @classmethod
    def for_group(cls, split: str, group) -> "TileLayout":
        rows, cols = tile_shape(split, group.size)
        return cls(rows, cols, group.rank // cols, group.rank % cols, tuple(group.ranks))

    @classmethod
    def of(cls, tiles: SpatialTiles) -> "TileLayout":
        """The layout a Program states (its spatial part)."""
        (rows, cols), (i, j) = tiles.grid, tiles.tile
        return cls(rows, cols, i, j, tiles.ranks)

    def rank_at(self, i: int, j: int) -> int:
        return self.ranks[i * self.cols + j]

    def tile_of(self, h: int, w: int) -> tuple[slice, slice]:
        """This rank's rows and columns of an (h, w) image."""
        bh, bw = bounds(h, self.rows), bounds(w, self.cols)
        return slice(bh[self.i], bh[self.i + 1]), slice(bw[self.j], bw[self.j + 1])



@dataclass(frozen=True)
class SpatialSpec:
    """How a stage splits images, as its generated code does it: spatial parallelism's part of a StageSpec
    (runtime/spec.py, under the key "spatial"; made by codegen.strategies.spatial.program; the stage code
    calls the tile ops, this records what it was written for).

    degree: tiles per image; split: a SpatialSplit; until: fx node name of the last spatial node
    of the stage, or None for a stage after the spatial part (it runs replicated on the tiles'
    devices); batchnorm: a SpatialBatchNorm.
    """

    key: ClassVar[str] = "spatial"
    degree: int
    split: str
    until: str | None
    batchnorm: str = SpatialBatchNorm.SYNC.value

    def __post_init__(self) -> None:
        tile_shape(self.split, self.degree)
        check_batchnorm(self.batchnorm)

    def to_dict(self) -> dict:
        return {"degree": self.degree, "split": self.split, "until": self.until, "batchnorm": self.batchnorm}

    @classmethod
    def from_dict(cls, d: dict) -> "SpatialSpec":
        until = d.get("until")
        return cls(int(d["degree"]), str(d["split"]), None if until is None else str(until),
                   str(d.get("batchnorm", SpatialBatchNorm.SYNC)))
