"""Checks of the values in a hardware description's fields (cost_models/hardware.py's Device, Link and
Cluster run them in their constructors, so a cluster file's values pass through them too).

Each check returns the value normalized (a whole float as an int, a mapping as sorted hashable pairs)
or raises FieldProblem naming the owner type, the field and what is wrong with it.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

KNOWN_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


class FieldProblem(ValueError):
    """A bad value for ``owner.field`` (``field`` may be dotted: ``peak_flops.bf16``)."""

    def __init__(self, owner: str, field: str, problem: str):
        super().__init__(f"{owner}.{field} {problem}")
        self.field = field
        self.problem = problem


def text_field(value: Any, owner: str, field: str, *, allow_empty: bool = False) -> str:
    """`value` as text (not blank unless `allow_empty`)."""
    if not isinstance(value, str):
        raise FieldProblem(owner, field, f"must be text, got {value!r} ({type(value).__name__})")
    if not allow_empty and not value.strip():
        raise FieldProblem(owner, field, "must not be empty")
    return value


def positive_int(value: Any, owner: str, field: str, unit: str) -> int:
    """`value` as an integer > 0 (`unit` goes into the message)."""
    # A file may say 80e9 for a byte count: accept floats that are whole numbers.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        got = f"{value!r} ({type(value).__name__})"
        raise FieldProblem(owner, field, f"must be a positive integer ({unit}), got {got}")
    return int(value)


def real_number(value: Any, owner: str, field: str, unit: str, *, allow_zero: bool = False) -> float:
    """`value` as a finite float > 0 (or >= 0 with `allow_zero`; `unit` goes into the message)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        got = f"{value!r} ({type(value).__name__})"
        raise FieldProblem(owner, field, f"must be a number ({unit}), got {got}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        sign = "zero or positive" if allow_zero else "positive"
        raise FieldProblem(owner, field, f"must be {sign} and finite ({unit}), got {value!r}")
    return value


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest known name, or ``''``."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def pairs_of(value: Any, owner: str, field: str, what: str) -> list[tuple[Any, Any]]:
    """The (key, value) pairs of a mapping or of an iterable of pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        return [(key, item) for key, item in items]
    except (TypeError, ValueError):
        raise FieldProblem(owner, field, f"must map {what}, got {value!r}") from None


def peak_table(value: Any) -> tuple[tuple[str, float], ...]:
    """A dtype -> FLOP/s mapping (or pairs) as sorted, hashable pairs."""
    pairs = pairs_of(value, "Device", "peak_flops", "dtype names to FLOP/s")
    if not pairs:
        raise FieldProblem("Device", "peak_flops", f"must give at least one of {KNOWN_DTYPES}")
    table: dict[str, float] = {}
    for dtype, flops in pairs:
        field = f"peak_flops.{dtype}"
        if dtype not in KNOWN_DTYPES:
            hint = did_you_mean(dtype, KNOWN_DTYPES)
            known = ", ".join(KNOWN_DTYPES)
            raise FieldProblem("Device", field, f"is not a known dtype.{hint} Known: {known}")
        if dtype in table:
            raise FieldProblem("Device", field, "is given twice")
        table[dtype] = real_number(flops, "Device", field, "FLOP/s")
    return tuple(sorted(table.items()))


def _scalar(item: Any, field: str, *, allow_none: bool = False) -> int | float | str | None:
    """A measured value JSON and YAML both carry exactly: an int, a finite float, text (or None)."""
    if item is None and allow_none:
        return None
    if isinstance(item, bool) or not isinstance(item, (int, float, str)):
        raise FieldProblem("Cluster", field, f"must be a number or text{' or null' if allow_none else ''}, "
                                            f"got {item!r}")
    if isinstance(item, float) and not math.isfinite(item):
        raise FieldProblem("Cluster", field, f"must be finite, got {item!r}")
    return item


def _record_table(item: Any, field: str) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """A table of records (a list of mappings of column name -> number, text or null, e.g. the op rows
    of a GPU calibration, raw.gpu_ops) as hashable nested pairs, rows and columns in their order."""
    if not all(isinstance(row, (Mapping, tuple)) for row in item):
        raise FieldProblem("Cluster", field, f"must be a number, text or a list of records (mappings of column "
                                            f"names to numbers, text or null), got {item!r}")
    rows = []
    for i, row in enumerate(item):
        pairs = pairs_of(row, "Cluster", f"{field}[{i}]", "column names to numbers, text or null")
        if any(not isinstance(k, str) for k, _ in pairs) or len({k for k, _ in pairs}) != len(pairs):
            raise FieldProblem("Cluster", f"{field}[{i}]", "must have unique text column names")
        rows.append(tuple((k, _scalar(v, f"{field}[{i}].{k}", allow_none=True)) for k, v in pairs))
    return tuple(rows)


def measurement_table(value: Any) -> tuple[tuple[str, Any], ...]:
    """Raw measurements (mapping or pairs of name -> number, text, or a table of records) as sorted pairs."""
    pairs = pairs_of(value, "Cluster", "measurements", "names to numbers, text or tables")
    table: dict[str, Any] = {}
    for key, item in pairs:
        field = f"measurements.{key}"
        if not isinstance(key, str) or key in table:
            raise FieldProblem("Cluster", field, "must be a unique text name")
        table[key] = _record_table(item, field) if isinstance(item, (list, tuple)) else _scalar(item, field)
    return tuple(sorted(table.items()))


def measurement_value(item: Any) -> Any:
    """A measurement as the file holds it: a table of records as a list of mappings."""
    return [dict(row) for row in item] if isinstance(item, tuple) else item
