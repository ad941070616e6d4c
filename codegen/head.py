"""The model's output layer in the stage graph: the loss fused with it, and its padded vocabulary.

`find_head` looks for a final linear layer whose output is the model's output (what
runtime.losses.model_output reads: the output itself, the first item of a tuple, a dict's
"logits"): an nn.Linear the graph calls (fx captures: the example GPT's lm_head) or an ATen
`linear` reading its weight directly (torch.export captures: Hugging Face GPT-2's lm_head, whose
weight is tied to the token embedding). Where the model uses the logits otherwise (post-processes
them, returns them twice) there is no head, and the reason says why.

With Execution.loss "chunked" (`fuse`), the stage returns the linear's input, the hidden state, in
the logits' place (the runtime computes the loss from it and the layer's weight:
runtime/execute/output_head.py); under tensor parallelism the linear's column input (copy_to_group, or the
sequence gather) goes too, since the chunked loss reduces the hidden state's gradient itself.

With Execution.vocab_multiple m > 1 the layer's rows are padded: at tensor degree 1 the weight (and
bias, and a tied embedding) hold V_pad = ceil(V / m) * m rows (StageSpec.padded) and, where the
logits are computed, a narrow to the first V follows the linear, so the model's logits keep their
size; under tensor parallelism each rank's block of the vocabulary split is rounded up to a multiple
of m (codegen/strategies/tensor/vocab.py's `pad_splits`: the splits' FeatureSplit gets the multiple, and
every size derived from it follows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from planner.graph.weight_op import weight_op
from runtime.losses import output_item
from runtime.execute.output_head import OutputHead
from runtime.program.shards import FeatureSplit, ParamShard
from runtime.comm.autograd import copy_to_group, gather_sequence


@dataclass(frozen=True, eq=False)
class HeadSite:
    """Where the output layer is in a graph.

    linear: the node computing the logits; module: its nn.Linear's path (fx captures), or None for an
    ATen linear; weight / bias: the stage module's names of its tensors (bias None: none); hidden: the
    linear's input as the model computes it; column: the tensor-parallel column input between hidden
    and the linear (copy_to_group or gather_sequence), or None; vocab: V, the layer's output features.
    """

    linear: fx.Node
    module: str | None
    weight: str
    bias: str | None
    hidden: fx.Node
    column: fx.Node | None
    vocab: int

    @property
    def sequence_dim(self) -> int | None:
        """The sequence dimension the column input gathers along (sequence parallelism), else None."""
        if self.column is not None and self.column.target is gather_sequence:
            return int(self.column.args[1])
        return None


def _attr_shape(gm: fx.GraphModule, target: str) -> tuple[int, ...]:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return tuple(obj.shape)


def find_head(g: fx.Graph, gm: fx.GraphModule) -> tuple[HeadSite | None, str]:
    """(the output layer of graph `g`, "") or (None, why the model has none), `gm` the captured
    module holding the full-size layers and weights."""
    out = next((n for n in g.nodes if n.op == "output"), None)
    lin = output_item(out.args[0], fx.Node) if out is not None else None
    if lin is None:
        return None, "the model's output is not a tensor the loss reads (a tensor, a tuple's first, a dict's 'logits')"
    if lin.op == "call_module":
        mod = gm.get_submodule(str(lin.target))
        if not isinstance(mod, nn.Linear):
            return None, (f"the model's output comes from {lin.target} ({type(mod).__name__}), not from a final "
                          "linear layer (the model post-processes its logits, or has no output layer)")
        site = HeadSite(lin, str(lin.target), f"{lin.target}.weight",
                        f"{lin.target}.bias" if mod.bias is not None else None, lin.args[0], None, mod.out_features)
    else:
        op = weight_op(lin)
        if op is None or op.kind != "linear" or len(_attr_shape(gm, str(op.weight.target))) != 2:
            what = f"{lin.op} {getattr(lin.target, '__name__', lin.target)}"
            return None, (f"the model's output is computed by {lin.name} ({what}), not by a final linear layer "
                          "(the model post-processes its logits, or has no output layer)")
        x, column = op.x, None
        if x.op == "call_function" and x.target in (copy_to_group, gather_sequence):
            x, column = x.args[0], x
            if len(column.users) != 1:
                return None, f"the output layer's input {column.args[0]} is read by other tensor-parallel ops too"
        site = HeadSite(lin, None, str(op.weight.target), str(op.bias.target) if op.bias is not None else None,
                        x, column, _attr_shape(gm, str(op.weight.target))[0])
    if not isinstance(site.hidden, fx.Node):
        return None, f"the output layer {lin.name} reads no tensor node"
    uses = [u for u in lin.users]
    seen = []
    fx.node.map_arg(out.args[0], lambda n: seen.append(n) if n is lin else None)
    if uses != [out] or len(seen) != 1:
        return None, (f"the model uses its logits ({lin.name}) other than returning them once (it post-processes "
                      "them, or returns them twice)")
    return site, ""


def fuse(g: fx.Graph, site: HeadSite) -> None:
    """The output node returns the hidden state in the logits' place; the linear (and its column
    input) leave the graph."""
    out = next(n for n in g.nodes if n.op == "output")
    out.replace_input_with(site.linear, site.hidden)
    g.erase_node(site.linear)
    if site.column is not None:
        g.erase_node(site.column)


def narrow_logits(g: fx.Graph, site: HeadSite, values: list[dict]) -> fx.Node:
    """After the linear of a padded layer (V_pad outputs), the first `site.vocab` logits: a narrow
    node that takes the linear's place in the output (its meta value, in each of `values`, is the
    linear's: the model's logits)."""
    with g.inserting_after(site.linear):
        cut = g.call_function(torch.narrow, (site.linear, -1, 0, site.vocab))
    cut.meta.update(site.linear.meta)
    out = next(n for n in g.nodes if n.op == "output")
    out.replace_input_with(site.linear, cut)
    for v in values:
        if site.linear.name in v:
            v[cut.name] = v[site.linear.name]
    return cut


def output_head(site: HeadSite, fused: bool, sequence_dim: int | None = None) -> OutputHead:
    """The StageSpec's head; sequence_dim: an nn.Linear column's sequence dimension (sequence parallelism)."""
    return OutputHead(weight=site.weight, vocab=site.vocab, bias=site.bias, fused=fused,
                      sequence_dim=site.sequence_dim if sequence_dim is None else sequence_dim)


def padded_rows(vocab: int, multiple: int, names: list[str]) -> tuple[ParamShard, ...]:
    """StageSpec.padded at tensor degree 1 for the stage's tensors `names` that hold the layer's
    `vocab` rows (its weight and bias, a tied embedding's weight under any of its names)."""
    split = FeatureSplit((vocab,), 0, multiple)
    return tuple(ParamShard(n, 0, split) for n in names)


__all__ = ["HeadSite", "find_head", "fuse", "narrow_logits", "output_head", "padded_rows"]
