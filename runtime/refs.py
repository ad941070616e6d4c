"""Resolve references such as "examples/models/gpt.py:build" to Python objects.

A reference is `PATH.py:NAME` (a file, relative to the working directory or
absolute) or `package.module:NAME` (an importable module). Rank scripts use
it to build the model and the data on every process, so it lives in the
runtime, which depends on nothing else in meshplan.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


class RefError(ValueError):
    """A model or data reference that cannot be resolved."""


def load_ref(ref: str) -> Any:
    """The object a "PATH.py:NAME" or "module:NAME" reference names."""
    if ":" not in ref:
        raise RefError(f"reference {ref!r} has no ':NAME' part; write it like 'examples/models/gpt.py:build'")
    where, name = ref.rsplit(":", 1)
    module = load_module(where)
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(k for k in vars(module) if not k.startswith("_"))
        raise RefError(f"{where} has no {name!r}; it defines: {', '.join(public)}") from None


def load_module(where: str):
    """Import a module from a file path ("x/y.py") or a dotted module name."""
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise RefError(f"model file {where!r} does not exist (looked at {path})")
        # A file under the working directory imports as its dotted name, so
        # that `from examples.models import gpt` elsewhere gets the same module.
        try:
            dotted = ".".join(path.relative_to(Path.cwd()).with_suffix("").parts)
        except ValueError:
            dotted = ""
        if dotted and all(p.isidentifier() for p in dotted.split(".")):
            if str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            try:
                return importlib.import_module(dotted)
            except ImportError:
                pass
        spec = importlib.util.spec_from_file_location(f"_meshplan_ref_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise RefError(f"cannot import module {where!r}: {e}") from None
