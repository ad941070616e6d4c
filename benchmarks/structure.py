"""The shape of the source tree, as issue 34 measures it: where each strategy lives, the longest
functions, the largest files and folders, and the files a plan passes through on its way to Programs.

    python benchmarks/structure.py            # the whole report
    python benchmarks/structure.py --no-trace # without emitting a build (no torch import)

Everything is read from the four packages' source with ast, except the emit path, which runs
codegen.emit.emit on a small tensor x pipeline plan of examples/models/gpt.py ("tiny") under a
profiler and lists the meshplan files whose functions ran. A "descent" there is a call from one
package into a lower one of the import order (codegen > planner > cost_models > runtime), counted once
per pair of files.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "codegen", "runtime", "cost_models")
LAYER = {"codegen": 3, "planner": 2, "cost_models": 1, "runtime": 0}

# A file implements a strategy where its path (relative to its package) names the strategy: the
# home modules (strategies/<name>.py, parallel/<name>.py) and the body files the issue lists.
STRATEGY_STEMS = {
    "data": ("strategies/data", "parallel/data", "grads"),
    "tensor": ("strategies/tensor", "parallel/tensor", "torch_stack/tensor", "tensor_split", "tensor_parallel",
               "sequence_split", "sharding", "weight_op", "shape_rewrite", "vocab_pad"),
    "pipeline": ("strategies/pipeline", "parallel/pipeline", "schedules", "stage_split"),
    "bidirectional": ("bidirectional",),
    "spatial": ("spatial",),
    "subgraph": ("subgraph",),
    "context": ("context_", "ring_attention", "strategies/context", "parallel/context"),
}


def sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _only_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return len(body) <= 1 and all(isinstance(n, ast.Expr) for n in body)


def strategy_files() -> dict[str, list[str]]:
    """Per strategy, the files that implement it (a package's docstring-only __init__.py left out)."""
    found = defaultdict(list)
    for path in sources():
        if _only_docstring(path):
            continue
        inner = rel(path).split("/", 1)[1]
        for name, stems in STRATEGY_STEMS.items():
            if any(stem in inner for stem in stems):
                found[name].append(rel(path))
    return found


def long_functions(limit: int = 80) -> list[tuple[int, str]]:
    out = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    out.append((length, f"{rel(path)}:{node.name}"))
    return sorted(out, reverse=True)


def long_files(limit: int = 500) -> list[tuple[int, str]]:
    sizes = [(len(p.read_text().splitlines()), rel(p)) for p in sources()]
    return sorted((n, f) for n, f in sizes if n > limit)[::-1]


def folders() -> list[tuple[int, int, str]]:
    """(python files, lines, folder) for each folder of the packages, largest first."""
    files, lines = Counter(), Counter()
    for path in sources():
        folder = rel(path.parent)
        files[folder] += 1
        lines[folder] += len(path.read_text().splitlines())
    return sorted(((files[f], lines[f], f) for f in files), reverse=True)


def emit_path() -> tuple[list[str], list[str]]:
    """(files entered, descents) while codegen.emit builds a data x tensor x pipeline GPT."""
    sys.path.insert(0, str(ROOT))
    from planner import Cluster, ParallelConfig, capture, make_plan   # noqa: E402  (after the path)
    from codegen.emit import emit
    from examples.models import gpt

    graph = capture(gpt.build(preset="tiny"), gpt.example_inputs(4, preset="tiny"))
    plan = make_plan(graph, Cluster.preset("dgx-a100-80gb", nodes=1),
                     ParallelConfig(data=2, tensor=2, pipeline=2, micro_batch_size=1), global_batch_size=4)
    entered: list[str] = []
    descents: set[tuple[str, str]] = set()
    stack: list[str] = []

    def package(filename: str) -> str | None:
        try:
            name = rel(Path(filename).resolve())
        except ValueError:
            return None
        return name if name.split("/")[0] in PACKAGES else None

    def profile(frame, event, arg):
        if event == "call":
            here = package(frame.f_code.co_filename)
            caller = stack[-1] if stack else None
            stack.append(here or caller)
            if here is None:
                return
            if here not in entered:
                entered.append(here)
            if caller and here != caller:
                up, down = LAYER[caller.split("/")[0]], LAYER[here.split("/")[0]]
                if down < up:
                    descents.add((caller, here))
        elif event == "return" and stack:
            stack.pop()

    with tempfile.TemporaryDirectory() as out:
        sys.setprofile(profile)
        try:
            emit(plan, "examples/models/gpt.py:build", out_dir=out, model_kwargs={"preset": "tiny"})
        finally:
            sys.setprofile(None)
    return entered, sorted(f"{a} -> {b}" for a, b in descents)


def named_outside() -> dict[str, set[str]]:
    """file -> the strategies it names outside their homes and the registries (the check of
    tests/unit/test_strategy_homes.py, which defines what naming one is)."""
    sys.path.insert(0, str(ROOT))
    from tests.unit.test_strategy_homes import _named
    return _named()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-trace", action="store_true", help="skip the emit path (no torch import)")
    args = parser.parse_args()
    print("files per strategy (path names it), and those outside its homes (planner/strategies/<name>,"
          " codegen/strategies/<name>, runtime/parallel/<name>):")
    for name, files in sorted(strategy_files().items()):
        homes = tuple(f"{pkg}/{name}" for pkg in ("planner/strategies", "codegen/strategies", "runtime/parallel"))
        outside = [f for f in files if not f.startswith(homes)]
        print(f"  {name:14s} {len(files):3d} files, {len(outside):2d} outside: {' '.join(outside)}")
    named = named_outside()
    print(f"\nfiles outside the homes and registries that name a strategy (tests/unit/test_strategy_homes.py): "
          f"{len(named)}")
    for name in sorted({s for found in named.values() for s in found}):
        print(f"  {name:14s} {sum(name in found for found in named.values()):3d}")
    funcs = long_functions()
    print(f"\nfunctions over 80 lines: {len(funcs)}")
    for n, f in funcs:
        print(f"  {n:4d}  {f}")
    files = long_files()
    print(f"\nfiles over 500 lines: {len(files)}")
    for n, f in files:
        print(f"  {n:4d}  {f}")
    print("\nlargest folders (python files, lines):")
    for n, lines, f in folders()[:6]:
        print(f"  {n:4d} {lines:6d}  {f}")
    total = sources()
    print(f"\npackages: {len(total)} files, {sum(len(p.read_text().splitlines()) for p in total)} lines")
    if not args.no_trace:
        entered, descents = emit_path()
        print(f"\nemit's path: {len(entered)} files, {len(descents)} descents")
        for f in sorted(entered):
            print(f"  {f}")
        print("  descents:")
        for d in descents:
            print(f"    {d}")


if __name__ == "__main__":
    main()
