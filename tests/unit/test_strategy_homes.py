"""The recipe for a dimension, checked: a strategy lives in its homes (planner/strategies/<name>/,
codegen/strategies/<name>[.py], runtime/parallel/<name>/) and is listed in the registries; no other
file names it, except those listed below, each with what still ties it there. The list may only
shrink: a file that names a strategy and is not listed fails, and so does a listed file that no
longer names it (take it off the list).

"Names a strategy", read from the source with ast: its StrategyName or MeshAxis member, a
ParallelConfig field of its own (its fields module's flags) read off a config (`config.spatial`,
`c.context`, `plan.config.bidirectional`) or passed to ParallelConfig/replace, or an import from its
homes. Data and pipeline parallelism are the mesh every plan has and are not counted.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from planner.strategies.fields import FIELDS
from runtime.vocab import StrategyName

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("planner", "codegen", "runtime", "cost_models")
CORE = (StrategyName.DATA, StrategyName.PIPELINE)
HOMES = ("planner/strategies/{n}/", "codegen/strategies/{n}/", "codegen/strategies/{n}.py", "runtime/parallel/{n}/")
# the lists of strategies, and the one list of a ParallelConfig's fields and the vocabulary
REGISTRIES = ("planner/strategies/registry.py", "planner/strategies/fields.py", "planner/strategies/combinations.py",
              "codegen/strategies/registry.py", "runtime/parallel/registry.py", "runtime/parallel/parts.py",
              "planner/config_fields.py", "runtime/vocab.py")
_CONFIGS = {"config", "c", "cfg"}

# file -> the strategies it still names, and why
# (empty since the tensor split's last shared users moved behind the node-splitting hooks: a file named here
# again needs a reason as strong)
STILL_NAMED: dict[str, tuple[tuple[str, ...], str]] = {}


def _names(tree: ast.AST, name: str, fields: set[str]) -> bool:
    member = name.upper()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == member and isinstance(node.value, ast.Name) and node.value.id in ("StrategyName", "MeshAxis"):
                return True
            base = node.value
            if node.attr in fields and ((isinstance(base, ast.Name) and base.id in _CONFIGS)
                                        or (isinstance(base, ast.Attribute) and base.attr == "config")):
                return True
        elif isinstance(node, ast.ImportFrom) and node.module and \
                re.search(rf"\.(strategies|parallel)\.{name}(\.|$)", node.module):
            return True
        elif isinstance(node, ast.Call) and any(k.arg in fields for k in node.keywords):
            f = node.func
            if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")) in ("ParallelConfig", "replace"):
                return True
    return False


def _named() -> dict[str, set[str]]:
    fields = {f.name.value: {fl.field for fl in f.flags} for f in FIELDS}
    found: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in REGISTRIES:
                continue
            tree = ast.parse(path.read_text())
            for s in StrategyName:
                if s in CORE or any(rel.startswith(h.format(n=s.value)) for h in HOMES):
                    continue
                if _names(tree, s.value, fields[s.value]):
                    found.setdefault(rel, set()).add(s.value)
    return found


def test_no_file_outside_the_homes_and_registries_names_a_strategy_beyond_the_list():
    found = _named()
    new = {f: sorted(s - set(STILL_NAMED.get(f, ((), ""))[0])) for f, s in found.items()}
    new = {f: s for f, s in new.items() if s}
    gone = {f: sorted(set(names) - found.get(f, set())) for f, (names, _) in STILL_NAMED.items()}
    gone = {f: s for f, s in gone.items() if s}
    assert not new, ("these files name strategies outside their homes and the registries; move the code into "
                     f"the strategy's home or behind a hook: {new}")
    assert not gone, f"these files no longer name the strategies listed for them; take them off STILL_NAMED: {gone}"


def test_the_check_sees_a_strategy_named_outside_its_home():
    fields = {"spatial", "spatial_until"}
    assert _names(ast.parse("x = plan.config.spatial > 1"), "spatial", fields)
    assert _names(ast.parse("from runtime.parallel.spatial.tiles import f"), "spatial", fields)
    assert _names(ast.parse("a = MeshAxis.SPATIAL"), "spatial", fields)
    assert _names(ast.parse("c = ParallelConfig(spatial=2)"), "spatial", fields)
    assert not _names(ast.parse("x = config.data; y = self.spatial"), "spatial", fields)
    assert not _names(ast.parse("from runtime.comm.context import DistContext"), "context", {"context"})


def test_the_same_one_strategy_splits_nodes_in_every_package():
    """The shared code reaches the node split through each package's hooks (the pricing's node_splitter, the
    Plan's node_split_fields, codegen's node_split_lowering): one strategy, the same in all three."""
    from codegen.strategies.registry import node_split_lowering
    from planner.strategies.fields import node_split_fields
    from planner.strategies.registry import STRATEGIES, node_splitter

    assert sum(s.splits_nodes for s in STRATEGIES) == 1
    assert node_splitter().name == node_split_fields().name == node_split_lowering().name
