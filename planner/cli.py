"""The `meshplan` command line. One verb per step; each has --help with examples.

    meshplan capture examples/models/gpt.py:build --arg preset=\"'1t'\" --batch 1
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


def _cmd_capture(args: argparse.Namespace) -> int:
    import torch

    from planner.capture import capture
    from runtime.refs import load_module, load_ref

    kwargs = _parse_kv(args.arg)
    factory = load_ref(args.model)
    module = load_module(args.model.rsplit(":", 1)[0])
    make_inputs = getattr(module, "example_inputs", None)
    if make_inputs is None:
        raise ValueError(f"{args.model.rsplit(':', 1)[0]} defines no example_inputs(batch_size, device, **kwargs); "
                         "add one so meshplan knows the shape of a batch")
    with torch.device("meta"):
        model = factory(**kwargs)
    inputs = make_inputs(batch_size=args.batch, device="meta", **kwargs)
    graph = capture(model, inputs)
    print(graph.summary(max_layers=args.max_layers))
    if args.output:
        graph.save(args.output)
        print(f"\nwrote {args.output}")
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cost_models.hardware import Cluster

    if args.name in Cluster.preset_names():
        cluster = Cluster.preset(args.name, nodes=args.nodes, devices=args.devices)
    elif Path(args.name).suffix in (".yaml", ".yml", ".json") or Path(args.name).exists():
        cluster = Cluster.load(args.name)
    else:
        raise ValueError(f"{args.name!r} is neither a preset ({', '.join(Cluster.preset_names())}) "
                         "nor a cluster file (.yaml/.yml/.json)")
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
