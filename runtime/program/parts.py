"""What a strategy adds to a Program: a part, kept under the strategy's name.

Most strategies need nothing in a rank's Program beyond its mesh coordinates and instructions.
Those whose ranks split one sample among themselves (spatial tiles of an image, context chunks of
a sequence) say which piece this rank holds in a part: a frozen dataclass in the strategy's home
(runtime/parallel/<name>/part.py) listed in runtime/parallel/parts.py. The Program stores the
parts it has, writes each under its `key` in the JSON document (the strategy's name, so
"spatial" and "context" as builds have always written them), and reads them back through that
list; no Program field names a strategy.
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterable, Mapping, Protocol, Sequence

from runtime.documents import Fields


class ProgramPart(Protocol):
    """One strategy's piece of a rank's Program.

    key: the strategy's name, and the part's key in the Program document.
    degree: how many consecutive coordinates of the data axis share one sample (the run the
        data shard divides by: Program.data_shard); 1 when the part does not split samples.
    ranks: the global ranks sharing a sample with this one (the strategy's group).
    """

    key: ClassVar[str]
    degree: int
    ranks: tuple[int, ...]

    def to_dict(self) -> dict: ...

    @classmethod
    def from_dict(cls, d: Mapping) -> "ProgramPart": ...

    @staticmethod
    def check_document(t: Fields, world: int, rank: int) -> None:
        """Raise Fields' error naming the first malformed field of the part's entry (called by
        runtime/program/check.py before from_dict, with the Program's world size and rank)."""

    def check_rank(self, rank: int) -> None:
        """Raise ProgramError when this part does not hold `rank` where it says it does."""

    def describe(self, rank: int) -> str:
        """One line for Program.__str__ (no leading '#')."""




def find_part(parts: Iterable[Any], key: str) -> Any:
    """The part under `key` among `parts` (anything with a `key`: a Program's, a StageSpec's or a Plan's
    parts), or None."""
    return next((p for p in parts if p.key == key), None)


def put_part(parts: Iterable[Any], part: Any, kinds: Sequence[type]) -> tuple:
    """`parts` with `part` added, or in place of the one under its key, in the order of `kinds` (the
    list of their kinds, as the document writes them)."""
    held = {p.key: p for p in parts if p.key != part.key} | {part.key: part}
    return tuple(held[k.key] for k in kinds if k.key in held)


__all__ = ["ProgramPart", "find_part", "put_part"]
