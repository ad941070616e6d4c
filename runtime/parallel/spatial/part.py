"""Spatial parallelism's part of a rank's Program (runtime/program/parts.py): which tile of each image
this rank's stage code runs, and the spatial group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

from runtime.documents import Fields
from runtime.program.instr_set import ProgramError
from runtime.vocab import StrategyName

_FIELDS = ("degree", "split", "grid", "tile", "ranks")


@dataclass(frozen=True)
class SpatialTiles:
    """This rank's part of spatial parallelism: which tile of each image its stage code runs.

    `degree` tiles per image, cut as `split` (runtime.vocab.SpatialSplit) into a `grid` of
    (rows, cols); this rank holds tile `tile` = (row, col); `ranks` is the spatial group, the
    global ranks holding the image's tiles in row-major tile order. They are `degree`
    consecutive coordinates of the data axis, and read the same micro-batches: the data
    shard of a rank is its data coordinate // degree. The data axis of the mesh holds
    data x degree ranks, and the collectives on it (gradients, statistics, the loss) reduce
    over data x spatial: the stage code scales each rank's loss by 1 / (data x degree) and
    the gather after the spatial part sums its gradient over the group, so that every
    gradient is a partial sum of the data-parallel kind.
    """

    key: ClassVar[str] = StrategyName.SPATIAL.value

    degree: int
    split: str
    grid: tuple[int, int]
    tile: tuple[int, int]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(int(x) for x in self.grid))
        object.__setattr__(self, "tile", tuple(int(x) for x in self.tile))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        (rows, cols), (i, j) = self.grid, self.tile
        if rows * cols != self.degree or len(self.ranks) != self.degree:
            raise ProgramError(f"spatial: a grid of {rows} x {cols} with ranks {list(self.ranks)} does not hold "
                               f"{self.degree} tiles")
        if not (0 <= i < rows and 0 <= j < cols):
            raise ProgramError(f"spatial: tile {self.tile} is outside the {rows} x {cols} grid")

    @property
    def index(self) -> int:
        """This rank's position in the spatial group (row-major tile order)."""
        return self.tile[0] * self.grid[1] + self.tile[1]

    def check_rank(self, rank: int) -> None:
        if rank != self.ranks[self.index]:
            raise ProgramError(f"spatial: tile {self.tile} is rank {self.ranks[self.index]}, not {rank}")

    def describe(self, rank: int) -> str:
        return (f"spatial {self.degree} ({self.split} {self.grid[0]} x {self.grid[1]}): tile {self.tile} of ranks "
                f"{list(self.ranks)}; the data axis holds data x spatial")

    def to_dict(self) -> dict:
        return {"degree": self.degree, "split": self.split, "grid": list(self.grid), "tile": list(self.tile),
                "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SpatialTiles":
        return cls(int(d["degree"]), str(d["split"]), tuple(d["grid"]), tuple(d["tile"]), tuple(d["ranks"]))

    @staticmethod
    def check_document(t: Fields, world: int, rank: int) -> None:
        """The "spatial" entry: a grid of degree tiles over ranks of the world, this rank's among them at its
        tile's place."""
        t.only(_FIELDS, _FIELDS)
        degree = t.integer("degree", minimum=1, maximum=world)
        if not t.text("split"):
            raise t.error("split", "must be the split's name")
        pairs = {}
        for key in ("grid", "tile"):
            v = t.items(key)
            if len(v) != 2:
                raise t.error(key, f"must be [rows, cols], got {v!r}")
            pairs[key] = [t.whole(t.path(f"{key}[{k}]"), x, minimum=0 if key == "tile" else 1)
                          for k, x in enumerate(v)]
        (rows, cols), (i, j) = pairs["grid"], pairs["tile"]
        if rows * cols != degree:
            raise t.error("grid", f"is {rows} x {cols}, not {degree} tiles")
        if i >= rows or j >= cols:
            raise t.error("tile", f"is ({i}, {j}), outside the {rows} x {cols} grid")
        ranks = t.items("ranks")
        for k, r in enumerate(ranks):
            t.whole(t.path(f"ranks[{k}]"), r, minimum=0, maximum=world - 1)
        if len(ranks) != degree or len(set(ranks)) != degree:
            raise t.error("ranks", f"must be {degree} distinct ranks, got {ranks}")
        if ranks[i * cols + j] != rank:
            raise t.error("ranks", f"holds rank {ranks[i * cols + j]} at tile ({i}, {j}), not this rank {rank}")


__all__ = ["SpatialTiles"]
