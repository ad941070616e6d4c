"""Checks of `meshplan` command-line values, done before any work starts.

Numbers: argparse `type=` callables with their bounds (argparse turns a refusal into one
line and exit 2). Paths: an output file or directory is checked (the nearest existing
directory is writable, a file is not a directory and the other way round) and its
missing parent directories are created, so that nothing is measured, searched or
trained only to be lost when it cannot be written. Nothing is overwritten unasked: an
output file that exists is refused unless the command was given --force (`refuse_existing`). Constraints: `--constraint KEY=VALUE`
values of the type each key takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import tempfile
import typing
from pathlib import Path
from typing import Any, Callable

from planner.config import ParallelConfig
from planner.config_fields import ConfigFields
from planner.plan import MAX_BATCH, MAX_WORLD
from planner.strategies.fields import FIELDS

__all__ = ["MAX_BATCH", "MAX_WORLD", "OutputError", "add_strategy_flags", "check_constraints", "config_from_flags", "count", "output_dir", "output_file",
           "positive_number", "nonnegative_number", "refuse_existing"]


class OutputError(ValueError):
    """An output path that cannot be written; the message names it and says what to give instead."""


def count(lo: int, hi: int | None = None, unit: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number in [lo, hi] (`unit` explains the upper bound)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}{unit}, got {v}")
        return v
    parse.__name__ = "count"  # argparse names the type in "invalid count value"
    return parse


def _number(text: str, ok: Callable[[float], bool], bound: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or not ok(v):
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
    return v


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, MiB, ...)."""
    return _number(text, lambda v: v > 0, "> 0")


def nonnegative_number(text: str) -> float:
    """An argparse type: a finite number >= 0 (tolerances, rates, ...)."""
    return _number(text, lambda v: v >= 0, ">= 0")


def _writable_base(path: Path, flag: str) -> Path:
    """The nearest existing ancestor of `path`, checked to be a directory we can create files in."""
    base = path.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise OutputError(f"{flag} {path}: {base} is a file, not a directory; choose a path in a directory")
    try:  # the one reliable test (permissions, read-only mounts, /proc): create a file and drop it
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot create files in {base} ({e.strerror or e}); "
                          "choose a writable directory") from None
    return base


def refuse_existing(paths, flag: str, force: bool) -> None:
    """OutputError naming the first of `paths` that exists, unless `force` (the command's --force)."""
    if force:
        return
    for p in paths:
        if Path(p).exists():
            raise OutputError(f"{flag} {p} exists; pass --force to replace it, or give another path")


def output_file(path: str, flag: str = "-o", *, force: bool = False) -> Path:
    """Check that a file can be written at `path` (creating its missing parent directories); an existing
    file is refused unless `force`."""
    p = Path(path).expanduser()
    if p.is_dir() or path.endswith(("/", "\\")):
        raise OutputError(f"{flag} {path} is a directory; give a file name")
    refuse_existing([p], flag, force)
    _writable_base(p, flag)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot create directory {p.parent} ({e.strerror or e})") from None
    return p


def output_dir(path: str, flag: str = "-o", create: bool = True) -> Path:
    """Check that `path` is, or can be created as, a writable directory (created here unless not
    `create`: a command that may still refuse its input creates it only when it writes)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise OutputError(f"{flag} {path} is a file; give a directory")
    if p.is_dir():
        _writable_base(p / "x", flag)
        return p
    _writable_base(p, flag)
    if not create:
        return p
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot create the directory ({e.strerror or e})") from None
    return p


def add_strategy_flags(p) -> None:
    """The strategies' ParallelConfig fields as flags (planner/strategies/<name>/fields.py lists each strategy's),
    with the type, default and choices ConfigFields gives them."""
    hints = typing.get_type_hints(ConfigFields)
    defaults = {f.name: f.default for f in dataclasses.fields(ConfigFields)}
    for flag in (fl for f in FIELDS for fl in f.flags):
        option, kind, default = "--" + flag.field.replace("_", "-"), hints[flag.field], defaults[flag.field]
        if kind is bool:
            p.add_argument(option, action="store_true", help=flag.help)
        elif isinstance(default, enum.Enum):
            p.add_argument(option, default=default.value, choices=list(map(str, type(default))), help=flag.help)
        elif kind is int:
            parse = int if flag.choices else count(1, MAX_BATCH, " samples") if flag.samples else count(1, MAX_WORLD, " devices")
            p.add_argument(option, type=parse, default=default, choices=list(flag.choices) or None, help=flag.help)
        else:
            p.add_argument(option, help=flag.help)


def config_from_flags(args, **more) -> ParallelConfig:
    """The ParallelConfig `meshplan codegen`'s flags give (the strategies' fields, add_strategy_flags), with
    `more` fields."""
    return ParallelConfig(**{fl.field: getattr(args, fl.field) for f in FIELDS for fl in f.flags}, **more)


# --constraint KEY=VALUE: what each key takes (planner.optimize checks the names). The ParallelConfig
# fields are read from ConfigFields by their annotated type (a new dimension's fields come with it); the
# search's limits are listed here.
def _config_keys(kind: type) -> tuple:
    """ConfigFields' fields that hold a `kind` (or None)."""
    hints = typing.get_type_hints(ConfigFields)
    return tuple(f for f in dataclasses.fields(ConfigFields) if hints[f.name] in (kind, kind | None))


_COUNTS = {**{f.name: min(f.default, 1) for f in _config_keys(int)}, "max_micro_batch_size": 1}   # the least
_FLAGS = (*(f.name for f in _config_keys(bool)), "allow_cross_node_tensor")
_POSITIVE = ("max_memory_fraction", "max_step_energy_j", "max_step_time_s")
_EXAMPLES = {"recompute": "selective", "spatial_until": "LAYER_NAME"}   # where the default is no example
_TEXT = {f.name: _EXAMPLES.get(f.name, f.default) for f in _config_keys(str)}


def check_constraints(cons: dict[str, Any]) -> dict[str, Any]:
    """`cons` with every value of the type its key takes; ValueError naming the key, the
    expected type and the value otherwise. Names are checked by planner.optimize."""
    for key, v in cons.items():
        if key in _COUNTS:
            lo = _COUNTS[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > MAX_WORLD * MAX_BATCH:
                raise ValueError(f"--constraint {key}={v!r}: {key} takes a whole number >= {lo} "
                                 f"(for example {key}={max(lo, 2)})")
        elif key in _FLAGS:
            if not isinstance(v, bool):
                raise ValueError(f"--constraint {key}={v!r}: {key} takes True or False")
        elif key in _POSITIVE:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"--constraint {key}={v!r}: {key} takes a number > 0")
        elif key in _TEXT and not isinstance(v, str):
            raise ValueError(f"--constraint {key}={v!r}: {key} takes a name (for example {key}={_TEXT[key]})")
    return cons
