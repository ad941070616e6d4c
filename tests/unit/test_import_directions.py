"""The import rules of README.md "Architecture" ("Imports go one way"), read from the source with ast:

- runtime imports no other meshplan package (a generated rank script imports only runtime);
- cost_models imports only runtime;
- codegen imports planner's types (the Plan and what it stores, the graph it binds to, the tables the
  planner decided with: PLANNER_FOR_CODEGEN), cost_models and runtime, never the application shell,
  the pricing or the search;
- planner imports cost_models and runtime, and only planner/app/ (the CLI and the rest of
  the shell) imports codegen;
- no import circles between modules;
- nothing in planner outside planner/app/ imports the shell, and `import planner` loads none of it
  (nor codegen);
- importing the CLI (every `meshplan` command's start) loads none of what only some commands use: torch's
  pipelining, Distributed Checkpoint, DTensor and dynamo, and OR-Tools (imported where they are used);
- the PyTorch-stack target (runtime/torch_script*.py, runtime/torch_stack/) is kept apart: no other
  runtime module, nor cost_models, imports it (meshplan's launcher and verify read a torch build's
  records through runtime/torch_records.py); codegen reaches it only from codegen/torch_target/.

Every import counts for the directions, those inside functions and under TYPE_CHECKING
included. Circles are looked for among all imports that ever run, those inside functions
included (a function-level import hides a circle, it does not remove it), and then among all
imports, those under TYPE_CHECKING included (a type checker reads them: a circle there is two
modules that each need the other's types; the strategies see the Evaluator, a config and a plan
through small protocols instead). Each test reports all its violations at once.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "cost_models", "codegen", "planner")
SHELL = "planner.app"   # the one part of planner that may import codegen
# the PyTorch-stack target's run-time side, and the code that may import it besides itself
TORCH_TARGET = ("runtime.torch_script", "runtime.torch_script_checkpoint", "runtime.torch_stack")
TORCH_TARGET_USERS = ("codegen.torch_target", SHELL)
# what codegen may import of planner: the Plan and what it stores (config, tensor splits, sub-graph regions),
# the graph it binds to (and the capture and binding check codegen runs to bind it), and the tables the
# planner decided with; never the pricing (the Evaluator, the strategies' hooks) or the search
PLANNER_FOR_CODEGEN = ("planner.plan", "planner.config", "planner.config_fields", "planner.graph.model",
                       "planner.graph.ops", "planner.graph.weight_op", "planner.graph.capture", "planner.binding",
                       "planner.capabilities",
                       "planner.strategies.combinations", "planner.strategies.subgraph.regions",
                       "planner.strategies.tensor.split")

# package -> the other meshplan packages it may import
ALLOWED = {
    "runtime": set(),
    "cost_models": {"runtime"},
    "codegen": {"planner", "cost_models", "runtime"},
    "planner": {"cost_models", "runtime"},
}


@dataclass(frozen=True)
class Import:
    """One import statement's meshplan target, as the module it names."""

    source: str    # importing module, dotted
    target: str    # imported module, dotted (the package or module named, never an attribute)
    line: int
    runs: bool     # False under TYPE_CHECKING: the import is only read by type checkers


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.Module):
    """(import node, runs) for every import in the module, those inside functions included."""
    def walk(node: ast.AST, runs: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, runs
            else:
                yield from walk(child, runs and not (isinstance(child, ast.If) and _is_type_checking(child)))
    yield from walk(tree, True)


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool, modules: dict[str, Path]):
    """The meshplan modules an import statement names (`from a import b` names a.b when b is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = source.split(".") if is_package else source.split(".")[:-1]
        anchor = here[:len(here) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    names = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
    return names or [base]


def _imports() -> list[Import]:
    modules = _modules()
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, runs in _statements(tree):
            for target in _targets(node, name, path.name == "__init__.py", modules):
                if target.split(".")[0] in PACKAGES:
                    found.append(Import(name, target, node.lineno, runs))
    return found


def _where(imp: Import) -> str:
    return f"{imp.source} (line {imp.line}) imports {imp.target}"


def _within(module: str, parents: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in parents)


def direction_problems(imports: list[Import]) -> list[str]:
    problems = []
    for imp in imports:
        src_pkg, dst_pkg = imp.source.split(".")[0], imp.target.split(".")[0]
        in_shell = _within(imp.source, (SHELL,))
        if _within(imp.target, TORCH_TARGET) and not _within(imp.source, TORCH_TARGET + TORCH_TARGET_USERS):
            problems.append(f"{_where(imp)}: only the torch target itself, codegen/torch_target and the shell "
                            "may import the torch target (read its records through runtime.torch_records)")
        if _within(imp.target, (SHELL,)) and not in_shell and src_pkg == "planner":
            problems.append(f"{_where(imp)}: nothing in planner outside {SHELL} imports the application shell")
        if src_pkg == dst_pkg:
            continue
        if dst_pkg == "codegen" and src_pkg == "planner":
            if not in_shell:
                problems.append(f"{_where(imp)}: only {SHELL} may import codegen")
        elif dst_pkg not in ALLOWED[src_pkg]:
            allowed = ", ".join(sorted(ALLOWED[src_pkg])) or "no other meshplan package"
            problems.append(f"{_where(imp)}: {src_pkg} may import {allowed}")
        elif src_pkg == "codegen" and (imp.target == SHELL or imp.target.startswith(SHELL + ".")):
            problems.append(f"{_where(imp)}: codegen may import planner's types, not the application shell")
        elif src_pkg == "codegen" and dst_pkg == "planner" and not _within(imp.target, PLANNER_FOR_CODEGEN):
            problems.append(f"{_where(imp)}: codegen imports only the plan's types of planner "
                            f"({', '.join(PLANNER_FOR_CODEGEN)})")
    return problems


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components (more than one module, or a module importing itself) of
    the graph of imports that run, each as a sorted list of module names."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.runs:
            graph.setdefault(imp.source, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(root: str) -> None:
        # Tarjan's algorithm, iterative: the module graph is deeper than Python's recursion limit allows for.
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1 or node in graph.get(node, ()):
                    components.append(sorted(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(components)


def test_imports_go_one_way():
    problems = direction_problems(_imports())
    assert not problems, (f"{len(problems)} import(s) against the import directions of README.md's Architecture section:\n  "
                          + "\n  ".join(problems))


def _circle_report(imports: list[Import]) -> tuple[list[list[str]], str]:
    cycles = import_cycles(imports)
    lines = []
    for members in cycles:
        edges = sorted(_where(i) for i in imports if i.runs and i.source in members and i.target in members)
        lines.append(" <-> ".join(members) + ":\n    " + "\n    ".join(edges))
    return cycles, "\n  ".join(lines)


def test_no_import_circles():
    cycles, report = _circle_report(_imports())
    assert not cycles, (f"{len(cycles)} import circle(s) among the modules; break each by moving the shared "
                        f"code into a module both import:\n  " + report)


def test_no_import_circles_through_type_checking_imports():
    cycles, report = _circle_report([replace(i, runs=True) for i in _imports()])
    assert not cycles, (f"{len(cycles)} circle(s) once the imports under TYPE_CHECKING count; have one side see "
                        f"the other through a Protocol of what it reads, or move the type into a module both "
                        f"import:\n  " + report)


def test_importing_planner_loads_no_shell():
    """`import planner` (the public API) loads neither planner/app/ nor codegen; planner.visualize is
    still there, loaded on first use."""
    code = ("import sys, planner; loaded = sorted(m for m in sys.modules if m.startswith(('planner.app', 'codegen')));"
            "print(loaded); assert not loaded, loaded; assert callable(planner.visualize) and "
            "'planner.app.visualize' in sys.modules")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_cli_starts_without_what_only_some_commands_use():
    """Every `meshplan` command starts by importing planner.app.cli; what only some commands use (a torch
    build's pipeline and Distributed Checkpoint, DTensor, and torch.compile's dynamo, which these import;
    OR-Tools, which only a search needs) is imported where it is used: together they made `meshplan --help`
    take 6.0 s here against 3.5 s."""
    heavy = ("torch._dynamo", "torch.distributed.pipelining", "torch.distributed.checkpoint",
             "torch.distributed.tensor", "ortools")
    code = f"import sys, planner.app.cli; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "[]", f"imported by planner.app.cli: {run.stdout.strip()}"


def test_the_checks_see_what_they_look_for():
    """The rules catch a known-bad import and a circle (so a passing run is not a blind one)."""
    bad = [Import("runtime.program", "planner.plan", 1, True), Import("planner.search", "codegen.lower", 2, False),
           Import("planner.app.cli", "codegen.emit", 3, True), Import("codegen.emit", "planner.app.cli", 4, True),
           Import("runtime.verify", "runtime.torch_script", 5, True), Import("planner.search", "planner.app.report", 6, False),
           Import("codegen.emit", "runtime.torch_stack.dcp", 7, True),
           Import("codegen.lower", "planner.evaluator", 8, True), Import("codegen.partition", "planner.search", 9, False)]
    assert len(direction_problems(bad)) == 8
    fine = [Import("runtime.torch_script", "runtime.torch_stack.dcp", 1, True),
            Import("codegen.torch_target.script", "runtime.torch_records", 2, True),
            Import("planner.app.cli", "runtime.torch_script_checkpoint", 3, True),
            Import("codegen.partition", "planner.strategies.tensor.split.rules", 4, True)]
    assert direction_problems(fine) == []
    circle = [Import("a.x", "a.y", 1, True), Import("a.y", "a.z", 2, True), Import("a.z", "a.x", 3, True),
              Import("a.z", "a.w", 4, True), Import("a.w", "a.x", 5, False)]
    assert import_cycles(circle) == [["a.x", "a.y", "a.z"]]
    assert any(i.target == "cost_models" or i.target.startswith("cost_models.")
               for i in _imports() if i.source.startswith("planner."))
