"""Module attributes found on first use: a module-level __getattr__ (PEP 562) that imports the module a
name lives in only when the name is asked for. The packages' public names use it (runtime, planner), and
so do the modules left at old paths for builds written before their code moved."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def forwarding(homes: str | Mapping[str, str], owner: str = "") -> Callable[[str], Any]:
    """A __getattr__ for a module. `homes`: the one module every name is looked up in (a module left at an
    old path), or name -> the module defining it (a package's public names; any other name raises
    AttributeError naming `owner`, the package)."""
    def __getattr__(name: str) -> Any:
        home = homes if isinstance(homes, str) else homes.get(name)
        if home is None:
            raise AttributeError(f"module {owner!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)
    return __getattr__


__all__ = ["forwarding"]
