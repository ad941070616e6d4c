"""The `meshplan` command line. One verb per step; each has --help with examples.

    meshplan capture examples/models/gpt.py:build --arg preset=1t --batch 1
    meshplan optimize examples/models/gpt.py:build --arg preset=gpt3-175b --cluster dgx-a100-80gb --nodes 16 --batch 1536
    meshplan cluster dgx-a100-80gb --nodes 2 -o cluster.yaml

User errors (bad references, files, sizes) print one line naming the problem
and exit with status 2; they never end in a traceback.
"""

from __future__ import annotations

import argparse
import ast
import sys
from typing import Any, Sequence

_EPILOG_CAPTURE = """examples:
  meshplan capture examples/models/gpt.py:build --arg preset=1t --batch 1
  meshplan capture examples/models/resnet.py:build --arg depth=1001 -o resnet.json
The model is built under torch.device("meta") (no memory) and its example
inputs come from example_inputs() in the same module as the factory."""

_EPILOG_OPTIMIZE = """examples:
  meshplan optimize examples/models/gpt.py:build --arg preset=gpt3-175b --cluster dgx-a100-80gb --nodes 16 --batch 1536
  meshplan optimize examples/models/gpt.py:build --arg preset=1t --cluster dgx-a100-80gb --nodes 384 \\
      --batch 3072 --constraint tensor=8 --constraint max_memory_fraction=0.9 -o plan_1t.json
Prints the plan, the runners-up with the reason each lost, and writes the plan as JSON."""

_EPILOG_CLUSTER = """examples:
  meshplan cluster dgx-a100-80gb --nodes 4
  meshplan cluster local --devices 2 -o local.yaml
  meshplan cluster my_cluster.yaml"""


def _parse_kv(items: Sequence[str]) -> dict[str, Any]:
    """`key=value` pairs; values are Python literals when they parse as one, else strings."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--arg {item!r} is not KEY=VALUE (for example --arg num_layers=4)")
        key, raw = item.split("=", 1)
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def capture_ref(model_ref: str, kwargs: dict[str, Any], batch: int):
    """Build the model a factory reference names on meta and capture it with its module's example_inputs."""
    import torch

    from planner.capture import capture
    from runtime.refs import load_module, load_ref

    factory = load_ref(model_ref)
    module = load_module(model_ref.rsplit(":", 1)[0])
    make_inputs = getattr(module, "example_inputs", None)
    if make_inputs is None:
        raise ValueError(f"{model_ref.rsplit(':', 1)[0]} defines no example_inputs(batch_size, device, **kwargs); "
                         "add one so meshplan knows the shape of a batch")
    with torch.device("meta"):
        model = factory(**kwargs)
    return capture(model, make_inputs(batch_size=batch, device="meta", **kwargs))


def resolve_cluster(name: str, nodes: int | None = None, devices: int | None = None):
    """A preset name (with nodes/devices) or a cluster file path."""
    from pathlib import Path

    from cost_models.hardware import Cluster

    if name in Cluster.preset_names():
        return Cluster.preset(name, nodes=nodes, devices=devices)
    if Path(name).suffix in (".yaml", ".yml", ".json") or Path(name).exists():
        if nodes or devices:
            raise ValueError("--nodes/--devices apply to presets; edit the cluster file instead")
        return Cluster.load(name)
    raise ValueError(f"{name!r} is neither a preset ({', '.join(Cluster.preset_names())}) "
                     "nor a cluster file (.yaml/.yml/.json)")


def _cmd_capture(args: argparse.Namespace) -> int:
    graph = capture_ref(args.model, _parse_kv(args.arg), args.batch)
    print(graph.summary(max_layers=args.max_layers))
    if args.output:
        graph.save(args.output)
        print(f"\nwrote {args.output}")
    return 0


def _cmd_optimize(args: argparse.Namespace) -> int:
    from planner.optimize import explain, optimize

    cluster = resolve_cluster(args.cluster, args.nodes, args.devices)
    graph = capture_ref(args.model, _parse_kv(args.arg), 1)
    plan = optimize(graph, cluster, global_batch_size=args.batch, objective=args.objective,
                    constraints=_parse_kv(args.constraint), progress=False if args.quiet else None)
    print(plan.summary())
    print()
    print(explain(plan))
    plan.save(args.output)
    print(f"\nwrote {args.output}")
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    cluster = resolve_cluster(args.name, args.nodes, args.devices)
    print(cluster.summary())
    if args.output:
        cluster.save(args.output)
        print(f"\nwrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshplan", description="Parallelization-strategy compiler for DL training.")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("capture", help="capture a model on meta tensors and print its graph summary",
                       epilog=_EPILOG_CAPTURE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL_REF", help="factory reference, e.g. examples/models/gpt.py:build")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory and example_inputs (repeatable)")
    p.add_argument("--batch", type=int, default=1, help="samples in the example batch (default 1)")
    p.add_argument("--max-layers", type=int, default=12, help="layers listed in the summary (default 12)")
    p.add_argument("-o", "--output", help="also write the ModelGraph as JSON here")
    p.set_defaults(func=_cmd_capture)

    p = sub.add_parser("optimize", help="search the best plan for a model on a cluster and write plan.json",
                       epilog=_EPILOG_OPTIMIZE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL_REF", help="factory reference, e.g. examples/models/gpt.py:build")
    p.add_argument("--cluster", required=True, metavar="PRESET_OR_FILE", help="cluster preset or file")
    p.add_argument("--nodes", type=int, help="nodes of a preset cluster")
    p.add_argument("--devices", type=int, help="devices of a preset cluster (for 'local', processes)")
    p.add_argument("--batch", type=int, required=True, help="global batch size (samples per step)")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory and example_inputs (repeatable)")
    p.add_argument("--objective", choices=["time", "energy"], default="time")
    p.add_argument("--constraint", action="append", default=[], metavar="KEY=VALUE",
                   help="fixed knob or limit, e.g. tensor=8, max_memory_fraction=0.9 (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default plan.json)")
    p.set_defaults(func=_cmd_optimize)

    p = sub.add_parser("cluster", help="show a preset or a cluster file, optionally save it",
                       epilog=_EPILOG_CLUSTER, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", metavar="PRESET_OR_FILE")
    p.add_argument("--nodes", type=int, help="number of nodes (presets only)")
    p.add_argument("--devices", type=int, help="devices (presets only; for 'local', processes)")
    p.add_argument("-o", "--output", help="write the cluster as YAML or JSON (by suffix)")
    p.set_defaults(func=_cmd_cluster)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"meshplan {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
