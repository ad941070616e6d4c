"""Which tokens of a sequence each context-parallel rank holds: the causal load-balanced split.

The sequence (length T) is cut into 2 * degree equal chunks; rank r holds chunks r and
2 * degree - 1 - r, in that order (Megatron-LM's context parallelism and Llama 3's long-context
training, "The Llama 3 Herd of Models", 2024, section 3.3.2). Under a causal mask an early chunk
attends to few keys and a late one to many, so pairing chunk r with its mirror gives every rank
the same attention work. With degree 1 the single rank holds the whole sequence in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


class ContextLayoutError(ValueError):
    """A sequence cannot be split over the context-parallel ranks as asked."""


@dataclass(frozen=True)
class ContextLayout:
    """Rank `rank` of `degree` context-parallel ranks, for sequences of `seq_len` tokens."""

    seq_len: int
    degree: int
    rank: int

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ContextLayoutError(f"context-parallel degree {self.degree} must be at least 1")
        if not 0 <= self.rank < self.degree:
            raise ContextLayoutError(f"context-parallel rank {self.rank} is outside 0..{self.degree - 1} "
                                     f"(degree {self.degree})")
        if self.seq_len <= 0 or self.seq_len % (2 * self.degree):
            raise ContextLayoutError(
                f"sequence length {self.seq_len} cannot be split over context-parallel degree {self.degree}: "
                f"the causal load-balanced split needs a multiple of 2 x {self.degree} = {2 * self.degree} "
                f"tokens; pad the sequences to a multiple of {2 * self.degree} or choose a degree that "
                f"divides {self.seq_len} // 2")

    @property
    def chunk_len(self) -> int:
        """Tokens per chunk: seq_len / (2 * degree)."""
        return self.seq_len // (2 * self.degree)

    @property
    def local_len(self) -> int:
        """Tokens this rank holds: seq_len / degree."""
        return self.seq_len // self.degree

    @property
    def chunks(self) -> tuple[int, int]:
        """The indices (in 0 .. 2 * degree - 1) of the two chunks this rank holds, in its order."""
        return self.rank, 2 * self.degree - 1 - self.rank

    def ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The global [start, stop) token ranges of this rank's two chunks, in its order."""
        c = self.chunk_len
        return tuple((i * c, (i + 1) * c) for i in self.chunks)

    def positions(self) -> torch.Tensor:
        """LongTensor (local_len,): the global position of each token this rank holds."""
        return torch.cat([torch.arange(a, b) for a, b in self.ranges()])

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of the full-sequence tensor `x` along `dim` (size seq_len there)."""
        if x.shape[dim] != self.seq_len:
            raise ContextLayoutError(f"a tensor of shape {tuple(x.shape)} has {x.shape[dim]} tokens along dim "
                                     f"{dim}; this layout splits {self.seq_len}")
        return torch.cat([x.narrow(dim, a, b - a) for a, b in self.ranges()], dim=dim)

    def put(self, full: torch.Tensor, part: torch.Tensor, dim: int) -> None:
        """Write this rank's `part` (local_len along `dim`) into its places of `full` (in place)."""
        c = self.chunk_len
        for i, (a, b) in enumerate(self.ranges()):
            full.narrow(dim, a, b - a).copy_(part.narrow(dim, i * c, c))


def chunk_layout(seq_len: int, degree: int, rank: int) -> ContextLayout:
    """Rank `rank`'s share of a `seq_len`-token sequence over `degree` context-parallel ranks."""
    return ContextLayout(seq_len, degree, rank)


def sequence_order(seq_len: int, degree: int) -> torch.Tensor:
    """LongTensor (seq_len,): the global positions of every rank's tokens, rank 0's first (the
    order an all-gather or all-to-all over the context group concatenates them in)."""
    return torch.cat([chunk_layout(seq_len, degree, r).positions() for r in range(degree)])


def whole_sequence(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The full-sequence tensor from every rank's part along `dim` (parts[r] from rank r)."""
    joined = torch.cat(list(parts), dim=dim)
    order = sequence_order(joined.shape[dim], len(parts)).to(joined.device)
    return joined.index_select(dim, torch.argsort(order))
