"""Resolve references such as "examples/models/gpt.py:build" to Python objects.

A reference is `PATH.py:NAME` (a file, relative to the working directory or
absolute) or `package.module:NAME` (an importable module). Rank scripts use
it to build the model and the data on every process, so it lives in the
runtime, which depends on nothing else in meshplan.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from typing import Any, Callable


class RefError(ValueError):
    """A model or data reference that cannot be resolved, or whose code failed (file and line named)."""


def where_raised(exc: BaseException, prefer: str | Path | None = None) -> str:
    """"FILE line N" of the frame that raised `exc`: the deepest frame in `prefer` (the user's
    file) when the traceback passes through it, else the deepest frame; a SyntaxError's own
    position. Empty when there is no traceback."""
    if isinstance(exc, SyntaxError) and exc.filename:
        same = prefer is not None and Path(exc.filename).resolve() == Path(prefer).resolve()
        return f"line {exc.lineno}" if same else f"{exc.filename} line {exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    mine = [f for f in frames if prefer is not None and Path(f.filename).resolve() == Path(prefer).resolve()]
    # Frames of importlib's machinery say nothing to the user: skip them when others exist.
    user = [f for f in frames if "importlib" not in f.filename] or frames
    f = (mine or user)[-1]
    return f"line {f.lineno}" if mine else f"{f.filename} line {f.lineno}"


def describe_failure(exc: BaseException, prefer: str | Path | None = None) -> str:
    """One line for an exception raised by user code: what it was, and where."""
    at = where_raised(exc, prefer)
    at = f" at {at}" if at else ""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}){at}"
    if isinstance(exc, SyntaxError):
        return f"has a syntax error{at}: {exc.msg}"
    if isinstance(exc, ImportError):
        missing = f" (module {exc.name!r} is not installed, or is misspelled)" if exc.name else ""
        return f"failed to import{at}: {exc}{missing}"
    text = str(exc).strip().splitlines()
    return f"raised {type(exc).__name__}{at}: {text[0] if text else '(no message)'}"


def check_call(fn: Callable, kwargs: dict, *, ref: str, what: str = "model factory", **fixed: Any) -> None:
    """RefError, naming the keywords `fn` accepts, unless `fn(**fixed, **kwargs)` fits its signature
    (nothing is called)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        sig.bind(**fixed, **kwargs)
    except TypeError as e:
        accepted = [p.name for p in sig.parameters.values()
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in fixed]
        raise RefError(f"{what} {ref}: {e}; it accepts {', '.join(accepted) or 'no keywords'}"
                       " (check the --arg keys)") from None


def call_factory(fn: Callable, kwargs: dict, *, ref: str, what: str = "model factory", **fixed: Any) -> Any:
    """`fn(**fixed, **kwargs)`, turning what user code raises into a RefError naming the file and
    line (SystemExit included; KeyboardInterrupt passes through). Keywords `fn` does not accept
    are refused before the call, naming the ones it does accept (check_call)."""
    check_call(fn, kwargs, ref=ref, what=what, **fixed)
    try:
        return fn(**fixed, **kwargs)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - user code may raise anything; name it
        raise RefError(f"{what} {ref} {describe_failure(e, inspect.getsourcefile(fn) if _has_source(fn) else None)}"
                       "; fix the code or its --arg values") from None


def _has_source(fn: Callable) -> bool:
    try:
        return inspect.getsourcefile(fn) is not None
    except TypeError:
        return False


def load_ref(ref: str, root: str | Path | None = None) -> Any:
    """The object a "PATH.py:NAME" or "module:NAME" reference names (paths relative to the
    working directory, else to `root`)."""
    if ":" not in ref:
        raise RefError(f"reference {ref!r} has no ':NAME' part; write it like 'examples/models/gpt.py:build'")
    where, name = ref.rsplit(":", 1)
    module = load_module(where, root)
    try:
        return getattr(module, name)
    except (Exception, SystemExit) as e:  # a module __getattr__ may raise anything
        if not isinstance(e, AttributeError):
            raise RefError(f"{ref}: looking up {name!r} {describe_failure(e)}") from None
        public = sorted(k for k in vars(module) if not k.startswith("_"))
        raise RefError(f"{where} has no {name!r}; it defines: {', '.join(public)}") from None


def load_callable(ref: str, root: str | Path | None = None, what: str = "model factory") -> Callable:
    """The callable a reference names; RefError (naming `what` and the reference) otherwise."""
    try:
        fn = load_ref(ref, root)
    except RefError as e:
        raise RefError(f"{what} {ref!r}: {e}") from None
    if not callable(fn):
        raise RefError(f"{what} {ref!r} names a value of type {type(fn).__name__}, not a callable; "
                       "point the reference at "
                       "a function or class (path/to/file.py:NAME)")
    return fn


def load_module(where: str, root: str | Path | None = None):
    """Import a module from a file path ("x/y.py") or a dotted module name.

    A relative path is looked up from the working directory, then from `root`
    (a generated build records the directory its refs were written against).
    """
    try:
        return _import(where, root)
    except RefError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - importing runs user code: name what failed
        raise RefError(f"{where} {describe_failure(e, where if where.endswith('.py') else None)}; "
                       "fix the file (running `python " + (where if where.endswith(".py") else f"-m {where}")
                       + "` shows the same)") from None


def _import(where: str, root: str | Path | None):
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
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            raise RefError(f"cannot import module {where!r}: {e}; check the name, or give a file path "
                           "(path/to/file.py:NAME)") from None
        raise
