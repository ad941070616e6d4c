"""Is a directory the same for every rank? Probed once at start, before the first step.

A checkpoint directory must be one directory that every rank writes into (rank 0 writes the
manifest once every rank's shard is there): on node-local storage each node sees only its own
ranks' files, and the first save would fail naming a rank that did write its file. `probe`
finds that out at start: rank 0 writes a file with a random token into each directory, the
token is broadcast, every rank says whether it sees the file (one all-gather of a flag per
directory), and rank 0 removes the files. Every rank gets the same answer, so every rank can
refuse with the same message.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Callable

PROBE_PREFIX = ".meshplan-shared-"


class NotSharedError(ValueError):
    """A directory that must be shared by all ranks is not (the message names the ranks)."""


def probe(dirs: list[str | Path], rank: int, world_size: int, broadcast: Callable[[list[int]], list[int]],
          all_gather: Callable[[list[int]], list[list[int]]]) -> list[list[int]]:
    """For each of `dirs`: the ranks that do not see the file rank 0 wrote there (a collective: every
    rank calls it with the same list of directories, each as that rank names it).

    broadcast(values) -> rank 0's values on every rank; all_gather(flags) -> every rank's flags, by rank.
    """
    paths = [Path(d) for d in dirs]
    token = 0
    if rank == 0:
        token = secrets.randbits(62)
        for p in paths:
            p.mkdir(parents=True, exist_ok=True)
            (p / f"{PROBE_PREFIX}{token:x}").write_text(str(token))
    token = broadcast([token])[0]
    try:
        seen = [int(_sees(p, token)) for p in paths]
        flags = all_gather(seen)
    finally:
        if rank == 0:
            for p in paths:
                (p / f"{PROBE_PREFIX}{token:x}").unlink(missing_ok=True)
    return [[r for r in range(world_size) if not flags[r][i]] for i in range(len(paths))]


def _sees(path: Path, token: int) -> bool:
    try:
        return (path / f"{PROBE_PREFIX}{token:x}").read_text() == str(token)
    except OSError:
        return False
