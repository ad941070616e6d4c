"""Context parallelism's part of a rank's Program (runtime/program/parts.py): which chunks of each
sequence this rank's stage code runs, and the context group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

from runtime.documents import Fields
from runtime.program.instr_set import ProgramError
from runtime.vocab import StrategyName

_FIELDS = ("degree", "seq_len", "dim", "ranks")


@dataclass(frozen=True)
class ContextShard:
    """This rank's part of context parallelism: which chunks of each sequence its stage code runs.

    `degree` ranks share every sequence of `seq_len` tokens; `ranks` is the context group (global
    ranks, in layout order: the k-th holds chunks k and 2 x degree - 1 - k of the causal
    load-balanced layout, runtime/parallel/context/attention.py). They are `degree` consecutive coordinates
    of the data axis and read the same micro-batches (Program.data_shard). The stage code takes
    its tokens from the full inputs itself; the runtime takes the targets, whose sequence is
    dimension `dim`, in the same order before the loss.
    """

    key: ClassVar[str] = StrategyName.CONTEXT.value

    degree: int
    seq_len: int
    dim: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if self.degree < 2 or len(self.ranks) != self.degree or len(set(self.ranks)) != self.degree:
            raise ProgramError(f"context: {self.degree} ranks per sequence need {self.degree} distinct ranks, "
                               f"got {list(self.ranks)}")
        if self.seq_len % (2 * self.degree) or self.dim < 0:
            raise ProgramError(f"context: a sequence of {self.seq_len} tokens does not cut into 2 x {self.degree} "
                               f"chunks (target dim {self.dim})")

    def index(self, rank: int) -> int:
        """The position of `rank` in the context group."""
        return self.ranks.index(rank)

    def check_rank(self, rank: int) -> None:
        if rank not in self.ranks:
            raise ProgramError(f"context: rank {rank} is not in its context group {list(self.ranks)}")

    def describe(self, rank: int) -> str:
        k = self.index(rank)
        return (f"context {self.degree}: sequence chunks {k} and {2 * self.degree - 1 - k} of {2 * self.degree}, "
                f"group {list(self.ranks)}; the data axis holds data x context")

    def to_dict(self) -> dict:
        return {"degree": self.degree, "seq_len": self.seq_len, "dim": self.dim, "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ContextShard":
        return cls(int(d["degree"]), int(d["seq_len"]), int(d["dim"]), tuple(d["ranks"]))

    @staticmethod
    def check_document(t: Fields, world: int, rank: int) -> None:
        """The "context" entry: degree distinct ranks of the world, this rank among them, and a sequence
        that cuts into 2 x degree chunks."""
        t.only(_FIELDS, _FIELDS)
        degree = t.integer("degree", minimum=2, maximum=world)
        seq_len = t.integer("seq_len", minimum=1)
        if seq_len % (2 * degree):
            raise t.error("seq_len", f"is {seq_len}, which does not cut into 2 x {degree} chunks")
        t.integer("dim", minimum=0)
        ranks = t.items("ranks")
        for k, r in enumerate(ranks):
            t.whole(t.path(f"ranks[{k}]"), r, minimum=0, maximum=world - 1)
        if len(ranks) != degree or len(set(ranks)) != degree:
            raise t.error("ranks", f"must be {degree} distinct ranks, got {ranks}")
        if rank not in ranks:
            raise t.error("ranks", f"is {ranks}, which does not hold this rank {rank}")


__all__ = ["ContextShard"]
