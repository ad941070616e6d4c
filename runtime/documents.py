"""The one reader for the JSON and YAML documents meshplan loads (plans, clusters, programs,
captured graphs, timelines), and typed field readers whose errors name the document and the field.

`read_document(path, what)` turns every way a file can be unreadable (missing, a directory, not
UTF-8, bad JSON or YAML, not an object) into one error that names the file. `Fields` then reads
the document's values one by one, so a damaged file is rejected with "plan file p.json: field
'stages[2].layers' must be a list of strings, got 3" instead of a KeyError from deep inside.
Loaders raise their own ValueError subclass: they pass it as `error`, or turn a FieldError into it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable

YAML_SUFFIXES = (".yaml", ".yml")


class DocumentError(ValueError):
    """A document file that cannot be read as a JSON or YAML object; the message names the file."""


class FieldError(ValueError):
    """A field of a document is missing or has the wrong type or value."""

    def __init__(self, where: str, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"{where}: field {field!r} {problem}")


def read_document(path: str | os.PathLike[str], what: str, *, error: Callable[[str], Exception] = DocumentError,
                  yaml: bool = False, top: type | tuple[type, ...] = dict, missing_hint: str = "") -> Any:
    """The parsed content of the file at `path`, a `what` ("plan file", "cluster file").

    yaml: also read YAML (by suffix: .json is JSON, .yaml/.yml YAML, any other JSON, else YAML);
    top: the type(s) the document must be (an object by default); missing_hint: appended to the
    message for a missing file. Every problem raises error(message), the message naming the file.
    """
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{what} {p} does not exist{missing_hint}") from None
    except IsADirectoryError:
        raise error(f"{what} {p} is a directory; pass the file inside it") from None
    except UnicodeDecodeError as e:
        raise error(f"{what} {p} is not UTF-8 text (byte {e.start}); is it the right file?") from None
    except OSError as e:
        raise error(f"{what} {p} cannot be read ({e.strerror or e})") from None
    data = parse_document(text, f"{what} {p}", suffix=p.suffix.lower() if yaml else ".json", error=error)
    if not isinstance(data, top):
        kinds = " or ".join(_TOP_NAMES.get(t, t.__name__) for t in (top if isinstance(top, tuple) else (top,)))
        raise error(f"{what} {p} must hold {kinds}, got {type(data).__name__}")
    return data


_TOP_NAMES = {dict: "an object (a mapping of fields)", list: "a list"}


def refuse_unknown_fields(d: Mapping, cls: type, what: str, error: Callable[[str], Exception] = DocumentError) -> None:
    """error("unknown <what> field(s) [...]; known: [...]") when mapping `d` holds a key that is not a field of the
    dataclass `cls`: the check every from_dict of a frozen settings class makes before building it."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        close = [m for k in unknown for m in difflib.get_close_matches(str(k), known, n=1)]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise error(f"unknown {what} field(s) {unknown}{hint}; known: {sorted(known)}")


def parse_document(text: str, where: str, *, suffix: str = ".json",
                   error: Callable[[str], Exception] = DocumentError) -> Any:
    """JSON (suffix .json), YAML (.yaml/.yml), or JSON else YAML (any other suffix) from `text`;
    error(message) names `where` when it does not parse. YAML (PyYAML) is imported only to read YAML."""
    fmt = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML"}.get(suffix, "JSON or YAML")
    unparsable: tuple[type[Exception], ...] = (ValueError, RecursionError)
    try:
        if suffix == ".json":
            return json.loads(text)
        import yaml

        unparsable += (yaml.YAMLError,)
        if suffix in YAML_SUFFIXES:
            return yaml.load(text, Loader=_yaml_loader())
        try:
            return json.loads(text)
        except ValueError:
            return yaml.load(text, Loader=_yaml_loader())
    except unparsable as e:
        raise error(f"{where} does not parse as {fmt}: {e}") from None


@functools.cache
def _yaml_loader() -> type:
    """SafeLoader that also reads ``312e12`` and ``3e-6`` as floats: YAML 1.1 (PyYAML) wants a dot
    and a signed exponent in a float, so plain SafeLoader would read these natural spellings as strings."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    return Loader


class Fields:
    """Reads the fields of one mapping; `where` names the document, `prefix` the mapping's dotted path."""

    def __init__(self, data: Any, where: str, prefix: str = "") -> None:
        self.where, self.prefix = where, prefix
        if not isinstance(data, Mapping):
            raise FieldError(where, prefix or "(top level)", f"must be an object (a mapping of fields), got {_show(data)}")
        self.data = data

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str, problem: str) -> FieldError:
        return FieldError(self.where, self.path(key), problem)

    def only(self, known: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
        """FieldError for a key outside `known` (first) or a missing `required` one."""
        unknown = sorted(str(k) for k in self.data if k not in known)
        if unknown:
            raise FieldError(self.where, self.prefix or "(top level)",
                             f"has unknown key(s) {unknown}; known: {list(known)}")
        for key in required:
            self.raw(key)

    def known(self, required: Mapping[str, str], optional: Iterable[str] = ()) -> None:
        """FieldError for a key that is neither in `required` (key -> what it means) nor in
        `optional`, naming the closest known field, or else for a missing required key with what it
        means. Unknown keys come first: a misspelt field is also a missing one, and the hint helps more."""
        known = [self.path(k) for k in (*required, *optional)]
        for key in self.data:
            if self.path(str(key)) not in known:
                close = difflib.get_close_matches(self.path(str(key)), known, n=1)
                hint = f"Did you mean '{close[0]}'?" if close else "Remove it."
                raise self.error(str(key), f"is not a known field. {hint} Known fields here: {', '.join(known)}.")
        for key, meaning in required.items():
            if key not in self.data:
                raise self.error(key, f"is missing ({meaning}). Add it to the file.")

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

    def choice(self, key: str, values: Iterable[str], default: Any = ...) -> str:
        """A string that is one of `values` (an enum's members, say)."""
        v = self.text(key, default)
        allowed = [str(x) for x in values]
        if v not in allowed:
            raise self.error(key, f"must be one of {', '.join(allowed)}, got {v!r}")
        return v

    def boolean(self, key: str, default: Any = ...) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self.error(key, f"must be true or false, got {_show(v)}")
        return v

    def integer(self, key: str, default: Any = ..., *, minimum: int | None = None,
                maximum: int | None = None) -> int:
        return self.whole(self.path(key), self.raw(key, default), minimum=minimum, maximum=maximum)

    def whole(self, path: str, v: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
        """`v`, the value at the full `path` (a list element, "mesh[0][1]"), as a whole number in range."""
        if isinstance(v, bool) or not isinstance(v, int):
            raise FieldError(self.where, path, f"must be a whole number, got {_show(v)}")
        if minimum is not None and v < minimum:
            raise FieldError(self.where, path, f"must be >= {minimum}, got {v}")
        if maximum is not None and v > maximum:
            raise FieldError(self.where, path, f"must be <= {maximum}, got {v}")
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
            raise self.error(key, f"must be a list, got {type(v).__name__}")
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
