"""The names the README documents resolve as written (`planner.Evaluator`, `planner.capabilities.check_target`,
`planner.app.report.write_report`, ...), and no function the package exports hides a module of the same
name (`planner.evaluate` the function once hid `planner.evaluate` the module, so `planner.evaluate.Evaluator`
raised AttributeError)."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import planner

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _resolve(dotted: str):
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for k, name in enumerate(parts[1:], 1):
        if not hasattr(obj, name):
            importlib.import_module(".".join(parts[:k + 1]))   # a submodule not imported yet
        obj = getattr(obj, name)
    return obj


def test_every_planner_name_the_readme_spells_resolves():
    names = sorted(set(re.findall(r"`(planner(?:\.\w+)+)", README)))
    assert "planner.Evaluator" in names and "planner.evaluate" in names
    for name in names:
        _resolve(name)
    assert _resolve("planner.Evaluator") is _resolve("planner.evaluator.Evaluator")
    assert callable(_resolve("planner.evaluate")) and not isinstance(_resolve("planner.evaluate"), type(planner))


def test_no_exported_name_is_also_a_module_of_the_package():
    modules = {m.name for m in pkgutil.iter_modules(planner.__path__)}
    assert not modules & set(planner.__all__), modules & set(planner.__all__)
    for name in planner.__all__:
        assert getattr(planner, name) is not None
