"""A captured graph specialized to one build: the device picked at run time, the micro-batch fixed.

Device: a torch.export graph bakes the capture device into its ops (`arange(8,
device=meta)`, `to(x, device=meta)`): meshplan captures on the meta device.
`debake_devices` replaces every device constant with one read of the stage module's
`run_device` attribute (runtime.materialize sets it when it places the stage), so the
generated line reads `arange = torch.ops.aten.arange.default(8, device=run_device, ...)`.

Batch: an export graph reads its symbolic batch size with `aten.sym_size.int`; a build
runs one micro-batch size, so `fold_batch_sizes` replaces those reads (and integer
arithmetic on them) by their value. A size then never has to cross a pipeline cut.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from planner.graph.ops import op_base
from runtime.materialize import RUN_DEVICE

_INT_OPS = {"sym_size", "mul", "add", "sub", "floordiv", "truediv", "mod", "neg", "sym_max", "sym_min",
            "sym_float", "sym_int", "sym_sum"}


def debake_devices(graph: fx.Graph) -> int:
    """Replace device constants in `graph` by `self.run_device`, in place; returns how many."""
    count = 0
    anchor: fx.Node | None = None

    def fix(a, key: str = ""):
        nonlocal count, anchor
        if isinstance(a, torch.device) or (key == "device" and isinstance(a, str)):
            if anchor is None:
                first = next(iter(graph.nodes))
                with graph.inserting_before(first):
                    anchor = graph.get_attr(RUN_DEVICE)
            count += 1
            return anchor
        return a

    for n in list(graph.nodes):
        if n.op not in ("call_function", "call_method"):
            continue
        args = tuple(fix(a) if not isinstance(a, fx.Node) else a for a in n.args)
        kwargs = {k: (fix(v, k) if not isinstance(v, fx.Node) else v) for k, v in n.kwargs.items()}
        if args != n.args or kwargs != n.kwargs:
            n.args, n.kwargs = args, kwargs
    return count


def fold_batch_sizes(graph: fx.Graph, values: dict) -> int:
    """Replace `aten.sym_size.int` reads, and integer arithmetic on nothing but them and
    constants, by their values in `values` (node name -> value of a run at the build's
    micro-batch size), in place; returns how many nodes were folded."""
    folded: set[str] = set()
    for n in list(graph.nodes):
        if n.op != "call_function" or not isinstance(values.get(n.name), int) or isinstance(values[n.name], bool):
            continue
        base = op_base(n.target)
        ins = n.all_input_nodes
        if base == "sym_size" or (base in _INT_OPS and ins and all(a.name in folded for a in ins)):
            n.replace_all_uses_with(values[n.name])
            folded.add(n.name)
    for n in reversed(list(graph.nodes)):
        if n.name in folded and not n.users:
            graph.erase_node(n)
    return len(folded)
