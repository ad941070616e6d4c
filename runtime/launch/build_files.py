"""Reading a build directory's JSON files (build.json, programs.json, plan.json) with one kind of error.

Every reader of a build (meshplan run, compare, simulate, verify) goes through `read_build_file`
(runtime/documents.py underneath): a missing, truncated, non-UTF-8 or non-JSON file is a BuildError
that names the file, says what is wrong and that the build must be made again; never a decoder's raw
message without the file.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.documents import read_document

REMAKE = "the build is damaged or was edited: make the build again (meshplan codegen ... -o BUILD)"


class BuildError(ValueError):
    """A build directory that is missing, incomplete or damaged."""


def read_build_file(build: str | os.PathLike, name: str, what: str, top: type = dict):
    """The parsed JSON file `name` of `build` (a `what`, e.g. "per-rank Programs file"); BuildError otherwise."""
    return read_document(Path(build) / name, what, top=top, error=lambda msg: BuildError(f"{msg}; {REMAKE}"))


def read_build(build: str | os.PathLike) -> dict:
    """build.json of `build`; BuildError when `build` is no build or the file is damaged."""
    if not (Path(build) / "build.json").is_file():
        raise BuildError(f"{build} is not a meshplan build (no build.json); create one with `meshplan codegen`")
    return read_build_file(build, "build.json", "build description")
