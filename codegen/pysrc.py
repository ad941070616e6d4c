"""Readable Python source from fx graphs: one method per graph, plus the imports it needs.

torch.fx's code generator writes the body; the names it refers to (its
"globals": torch, user functions called with call_function, ...) become
ordinary import lines, so the emitted rank script runs without fx.

Generated files are data, never code paths for user strings: a string from the user or the
model (a reference, an argument, a module path, a line of the model's source) lands in a
generated file only as a literal (repr, py_literal), in a comment through comment_text, or in
a docstring through doc_text; an import line names only dotted identifiers.
"""

from __future__ import annotations

import builtins
import re
import types
from typing import Any

import torch
import torch.fx as fx

from planner.graph.ops import module_stack

# Globals fx always provides, and how to write them in a standalone file.
_STANDARD = {
    "torch": "import torch",
    "inf": "from math import inf",
    "nan": "from math import nan",
    "NoneType": "NoneType = type(None)",
    "device": "from torch import device",
    "fx_pytree": "import torch.fx._pytree as fx_pytree",
    "pytree": "import torch.utils._pytree as pytree",
}


class SourceError(ValueError):
    """A graph refers to something that cannot be imported by name in a generated file."""


def comment_text(text: str) -> str:
    """`text` for a `#` comment in generated Python: kept as is when every character is printable,
    else written as its repr (which escapes line breaks), so a comment can never end early and
    turn the rest of a line from the user or the model into code."""
    return text if text.isprintable() else repr(text)


def doc_text(text: str) -> str:
    """`text` for a triple-double-quoted docstring in generated Python: comment_text with its
    backslashes and double quotes escaped, so it can neither close the docstring nor start an
    escape; the docstring's value shows comment_text(text) exactly."""
    return comment_text(text).replace("\\", "\\\\").replace('"', '\\"')


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _checked(line: str, *names: str) -> str:
    """`line` when every name in it is a dotted identifier, else SourceError: an import line in a
    generated file holds names, never other text."""
    bad = [n for n in names if not _dotted(n)]
    if bad:
        raise SourceError(f"generated code would import {bad[0]!r}, which is not a dotted Python name; "
                          "define what the model calls at module level in a module with an importable name")
    return line


def import_line(name: str, obj: Any) -> str | None:
    """The line that binds `name` to `obj` in a generated module (None for builtins)."""
    if name in _STANDARD:
        return _STANDARD[name]
    if name.startswith("__import__") and isinstance(obj, str):
        return _checked(obj, obj.removeprefix("import "))  # "import a.b", asked for verbatim
    if getattr(builtins, name, None) is obj:
        return None
    if isinstance(obj, types.ModuleType):
        return _checked(f"import {obj.__name__} as {name}" if obj.__name__ != name else f"import {name}",
                        obj.__name__, name)
    if isinstance(obj, str):
        return _checked(f"{name} = {obj}", name, obj)
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not mod or not qual or "<" in qual:
        raise SourceError(f"generated code needs {name!r} = {obj!r}, which cannot be imported by name; "
                          "define it at module level in the model's file")
    if mod.startswith("torch._ops") or isinstance(obj, torch._ops.OpOverload):
        return _checked(f"{name} = {obj!s}", name, str(obj))
    if "." in qual:
        head, rest = qual.split(".", 1)
        return _checked(f"from {mod} import {head} as _{name}_owner\n{name} = _{name}_owner.{rest}", mod, qual, name)
    return _checked(f"from {mod} import {qual} as {name}" if qual != name else f"from {mod} import {qual}",
                    mod, qual, name)


def graph_method(graph: fx.Graph, method: str, indent: str = "    ") -> tuple[str, dict[str, Any]]:
    """Source of a method `method(self, <placeholders>)` running `graph`, and its globals.

    Where the module a line belongs to changes, a comment names it, its class and the line of
    the model's own source the op came from (torch.export and fx record both on each node).
    """
    for n in graph.nodes:
        n.type = None
        if n.op in ("get_attr", "call_module"):
            check_call_target(n.target)
    pc = graph.python_code(root_module="self")
    src = pc.src.strip("\n")
    src = re.sub(r"^def forward\(", f"def {method}(", src, count=1)
    notes = {n.name: _origin(n) for n in graph.nodes if n.op in ("call_function", "call_method")}
    lines, last = [], (None, None)
    for ln in src.splitlines():
        m = re.match(r"\s*(\w+) = ", ln)
        origin = notes.get(m.group(1)) if m else None
        if origin is not None and origin[0] and origin != last:
            path, cls, code = origin
            if path != last[0]:
                lines.append(f"{indent}    # {comment_text(path)}{f' ({comment_text(cls)})' if cls else ''}")
            if code:
                lines.append(f"{indent}    #   {comment_text(code)}")
            last = origin
        lines.append(indent + ln if ln.strip() else "")
    return "\n".join(lines).rstrip() + "\n", dict(pc.globals)


def check_call_target(target: str) -> None:
    """torch.fx writes a module path part that is not an identifier as `getattr(x, "part")` without
    escaping it: refuse a part that would end that string (a double quote, a backslash, a line break)."""
    for part in target.split("."):
        if not part.isidentifier() and not (part.isprintable() and '"' not in part and "\\" not in part):
            raise SourceError(f"the model has a module or parameter named {part!r} (in {target!r}); torch.fx "
                              "cannot write a name with a double quote, backslash or line break into code: "
                              "rename it")


def _origin(node: fx.Node) -> tuple[str, str, str] | None:
    """(module path, class name, source line) a node was traced from, or None."""
    stack = module_stack(node)
    if not stack:
        return None
    path, cls = stack[-1]
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    code = trace[-1].strip() if trace and not trace[-1].lstrip().startswith("File ") else ""
    return path, cls.rsplit(".", 1)[-1], code[:100]


def import_block(globals_: dict[str, Any]) -> list[str]:
    """Sorted, de-duplicated import lines for the union of several methods' globals."""
    lines = []
    for name, obj in sorted(globals_.items()):
        line = import_line(name, obj)
        if line and line not in lines:
            lines.append(line)
    return lines


def py_literal(x: Any, width: int = 100) -> str:
    """A Python literal for JSON-like data (dict/list/str/number/bool/None), pretty-printed."""
    import pprint

    return pprint.pformat(x, width=width, sort_dicts=False)

