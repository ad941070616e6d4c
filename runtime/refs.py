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


def load_ref(ref: str, root: str | Path | None = None) -> Any:
    """The object a "PATH.py:NAME" or "module:NAME" reference names (paths relative to the
    working directory, else to `root`)."""
    if ":" not in ref:
        raise RefError(f"reference {ref!r} has no ':NAME' part; write it like 'examples/models/gpt.py:build'")
    where, name = ref.rsplit(":", 1)
    module = load_module(where, root)
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(k for k in vars(module) if not k.startswith("_"))
        raise RefError(f"{where} has no {name!r}; it defines: {', '.join(public)}") from None


def load_module(where: str, root: str | Path | None = None):
    """Import a module from a file path ("x/y.py") or a dotted module name.

    A relative path is looked up from the working directory, then from `root`
    (a generated build records the directory its refs were written against).
    """
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_absolute() and not path.exists() and root is not None and (Path(root) / path).exists():
            path = Path(root) / path
        path = path.resolve()
        if not path.is_file():
            raise RefError(f"model file {where!r} does not exist (looked at {path})")
        # A file under the working directory (or under root) imports as its dotted name,
        # so that `from examples.models import gpt` elsewhere gets the same module.
        for base in [Path.cwd()] + ([Path(root).resolve()] if root is not None else []):
            try:
                dotted = ".".join(path.relative_to(base).with_suffix("").parts)
            except ValueError:
                continue
            if dotted and all(p.isidentifier() for p in dotted.split(".")):
                if str(base) not in sys.path:
                    sys.path.insert(0, str(base))
                try:
                    return importlib.import_module(dotted)
                except ImportError:
                    pass
        name = f"_meshplan_ref_{path.stem}"
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise RefError(f"cannot import module {where!r}: {e}") from None
