"""Small typed readers for JSON documents, raising errors that name the dotted field.

Loaders (plans, predictions, configs) read every value through `Fields`, so
a damaged file is rejected with "field 'stages[2].layers' must be a list of
strings, got 3" instead of a KeyError or TypeError from deep inside.
"""

from __future__ import annotations

import math
from typing import Any, Callable


class FieldError(ValueError):
    """A field of a document is missing or has the wrong type or value."""

    def __init__(self, where: str, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"{where}: field {field!r} {problem}")


class Fields:
    """Reads the fields of one mapping; `where` names the document, `prefix` the mapping's path."""

    def __init__(self, data: Any, where: str, prefix: str = "") -> None:
        self.where, self.prefix = where, prefix
        if not isinstance(data, dict):
            raise FieldError(where, prefix or "(top level)", f"must be a JSON object, got {_show(data)}")
        self.data = data

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str, problem: str) -> FieldError:
        return FieldError(self.where, self.path(key), problem)

    def raw(self, key: str, default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise self.error(key, "is missing")
            return default
        return self.data[key]

    def sub(self, key: str, default: Any = ...) -> "Fields":
        return Fields(self.raw(key, default), self.where, self.path(key))

    def text(self, key: str, default: Any = ...) -> str:
        v = self.raw(key, default)
        if not isinstance(v, str):
            raise self.error(key, f"must be a string, got {_show(v)}")
        return v

    def boolean(self, key: str, default: Any = ...) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self.error(key, f"must be true or false, got {_show(v)}")
        return v

    def integer(self, key: str, default: Any = ..., *, minimum: int | None = None) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(key, f"must be a whole number, got {_show(v)}")
        if minimum is not None and v < minimum:
            raise self.error(key, f"must be >= {minimum}, got {v}")
        return v

    def number(self, key: str, default: Any = ..., *, minimum: float | None = None) -> float:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(key, f"must be a finite number, got {_show(v)}")
        if minimum is not None and v < minimum:
            raise self.error(key, f"must be >= {minimum}, got {v}")
        return float(v)

    def optional_number(self, key: str) -> float | None:
        return None if self.raw(key, None) is None else self.number(key)

    def items(self, key: str, default: Any = ...) -> list:
        v = self.raw(key, default)
        if not isinstance(v, (list, tuple)):  # tuples: documents built in memory by to_dict()
            raise self.error(key, f"must be a list, got {_show(v)}")
        return list(v)

    def strings(self, key: str, default: Any = ...) -> list[str]:
        v = self.items(key, default)
        if not all(isinstance(x, str) for x in v):
            raise self.error(key, f"must be a list of strings, got {_show(v)}")
        return v

    def each(self, key: str, read: Callable[["Fields"], Any], default: Any = ...) -> list:
        """Read every element of a list of objects with `read`."""
        return [read(Fields(x, self.where, f"{self.path(key)}[{i}]")) for i, x in enumerate(self.items(key, default))]


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
