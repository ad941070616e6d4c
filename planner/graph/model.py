"""The captured model: `ModelGraph` with per-node `OpInfo`, pipeline cut
candidates (`Layer`) and independent fork/join regions (`Branch`).

Everything here is a frozen dataclass that round-trips through plain JSON
(`to_dict` / `from_dict`). The fx `GraphModule` the graph was captured from
rides along in `ModelGraph.module` for codegen, but is not part of equality
or of the JSON form.

Units: FLOPs are floating-point operations (a multiply-add counts 2, as
torch.utils.flop_counter counts them); sizes are bytes; shapes are tuples of
ints. All per-node figures are for the example batch the graph was captured
with (`ModelGraph.batch_size` samples); divide by it for one sample.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from runtime.documents import read_document
from runtime.vocab import OpKind, element_bytes

GRAPH_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor value (no data)."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * element_bytes(self.dtype)


@dataclass(frozen=True)
class OpInfo:
    """One fx node with what the cost model needs to price it.

    `kind` is the normalized op kind the cost models dispatch on (runtime.vocab.OpKind:
    input, output, param, scalar, linear, matmul, conv, attention, embedding, norm,
    softmax, pool, concat, loss, view, elementwise); a graph file holds its value.
    """

    name: str                      # fx node name (unique in the graph)
    op: str                        # fx opcode: placeholder, get_attr, call_module, call_function, call_method, output
    target: str                    # module class, function or method name, e.g. "torch.nn.Linear", "aten.addmm"
    kind: OpKind
    module_path: str               # innermost owning module, e.g. "blocks.3.attn.qkv" ("" for the top level)
    inputs: tuple[str, ...]        # names of the nodes this one reads (in argument order)
    input_meta: tuple[TensorMeta, ...]   # the tensor inputs (activations, not parameters)
    output_meta: tuple[TensorMeta, ...]  # the tensor outputs (a tuple for multi-output ops)
    fwd_flops: int
    bwd_flops: int                 # grad of inputs that need it plus grad of the parameters
    param_count: int               # parameters first used by this node (shared ones counted once)
    param_bytes: int
    param_names: tuple[str, ...]   # qualified parameter names, e.g. "blocks.3.attn.qkv.weight"
    output_bytes: int              # bytes of the output activation(s)
    saved_bytes: int               # activation bytes this node saves for backward (excludes parameters)
    bytes_read: int                # input activations + parameters read in forward
    bytes_written: int             # outputs written in forward
    requires_grad: bool            # whether the output carries gradient in training
    # Scalar settings of the op: a module's kernel_size/stride/padding/p/eps...,
    # a function's scalar arguments (dropout_p, is_causal, ...), as (name, value) pairs.
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    @property
    def is_compute(self) -> bool:
        return self.kind not in (OpKind.INPUT, OpKind.OUTPUT, OpKind.PARAM, OpKind.SCALAR, OpKind.VIEW)


@dataclass(frozen=True)
class Layer:
    """A contiguous run of nodes between two pipeline cut candidates.

    `boundary` is the set of activations that cross the cut after this layer
    (what a pipeline stage ending here sends); `side_inputs` are tensors that
    reach many layers from far away (attention masks, rotary tables) and are
    sent along with the boundary or recomputed.
    """

    name: str                      # owning module path ("blocks.3") or the first node's name
    index: int
    nodes: tuple[str, ...]         # fx node names, in graph order
    signature: str                 # identical repeated layers share it
    fwd_flops: int
    bwd_flops: int
    param_count: int
    param_bytes: int
    saved_bytes: int               # activations saved for backward by this layer's nodes
    boundary: tuple[str, ...]      # activations live across the cut after this layer
    boundary_bytes: int
    side_inputs: tuple[str, ...]


class BranchKind(StrEnum):
    """What a Branch's independent paths are (planner/graph/branches.py finds both)."""

    PARALLEL = "parallel"   # separate chains of nodes between a fork and a join (Inception branches)
    HEADS = "heads"         # the heads of one attention op


@dataclass(frozen=True)
class Branch:
    """A fork/join region whose paths are independent (sub-graph parallelism).

    kind "parallel": `paths` lists the node names of each independent path
    between `fork` (whose output feeds every path) and `join` (which consumes
    all of them), e.g. Inception branches or separate q/k/v projections.
    kind "heads": an attention op whose `width` heads are independent; `paths`
    is empty and `fork`/`join` are the attention node itself.
    """

    kind: BranchKind
    fork: str
    join: str
    paths: tuple[tuple[str, ...], ...]
    width: int                     # number of independent paths (heads for kind "heads")
    module_path: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", BranchKind(self.kind))   # a graph file holds the text


@dataclass(frozen=True)
class ModelGraph:
    """A captured model: nodes, layers and branches, plus totals.

    `module` (not compared, not serialized) is the fx GraphModule the nodes
    name; it holds no parameter memory when the model was on meta.
    `shared_params` lists the names of each parameter used under several names.
    """

    model_class: str
    method: str                    # "fx" or "export"
    batch_dim: int
    batch_size: int                # samples in the example inputs
    nodes: tuple[OpInfo, ...]
    layers: tuple[Layer, ...]
    branches: tuple[Branch, ...]
    fingerprint: str
    format_version: int = GRAPH_FORMAT_VERSION
    module: Any = field(default=None, compare=False, repr=False)
    # Parameters the model uses under several names (tied weights: GPT-2's token embedding
    # and output layer): each group holds every name of one parameter, canonical name
    # (the one model.named_parameters() gives) first.
    shared_params: tuple[tuple[str, ...], ...] = ()
    shared_numel: tuple[int, ...] = ()   # elements of each shared parameter (same order)
    # where the model draws random numbers in training, "<module path> (<what>)" (planner/graph/randomness.py)
    random_ops: tuple[str, ...] = ()

    # ---- look-ups -------------------------------------------------------
    def node(self, name: str) -> OpInfo:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in the graph of {self.model_class}")

    @property
    def total_fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes)

    @property
    def total_bwd_flops(self) -> int:
        return sum(n.bwd_flops for n in self.nodes)

    @property
    def num_params(self) -> int:
        return sum(n.param_count for n in self.nodes)

    @property
    def param_bytes(self) -> int:
        return sum(n.param_bytes for n in self.nodes)

    @property
    def saved_bytes(self) -> int:
        return sum(n.saved_bytes for n in self.nodes)

    def unique_layers(self) -> dict[str, list[Layer]]:
        """Layers grouped by signature: each group is costed once."""
        groups: dict[str, list[Layer]] = {}
        for layer in self.layers:
            groups.setdefault(layer.signature, []).append(layer)
        return groups

    # ---- text -----------------------------------------------------------
    def summary(self, max_layers: int = 12) -> str:
        """A readable multi-line description: totals, layers and branches."""
        b = self.batch_size
        lines = [
            f"ModelGraph of {self.model_class} (captured with {self.method}, batch {b} on dim {self.batch_dim})",
            f"  nodes: {len(self.nodes)}   layers: {len(self.layers)} "
            f"({len(self.unique_layers())} distinct)   branches: {len(self.branches)}",
            f"  parameters: {self.num_params:,} ({_fmt_bytes(self.param_bytes)})",
            f"  forward:  {_fmt_flops(self.total_fwd_flops)} for the batch "
            f"({_fmt_flops(self.total_fwd_flops / b)} per sample)",
            f"  backward: {_fmt_flops(self.total_bwd_flops)} for the batch",
            f"  activations saved for backward: {_fmt_bytes(self.saved_bytes)} for the batch",
            f"  fingerprint: {self.fingerprint[:16]}",
            "",
            f"  {'#':>4}  {'layer':<28} {'params':>14} {'fwd FLOPs':>11} {'saved':>10} {'boundary':>10}",
        ]
        shown = self.layers
        elided = 0
        if len(shown) > max_layers:
            head = max_layers // 2
            elided = len(shown) - max_layers
            shown = shown[:head] + shown[len(shown) - (max_layers - head):]
        for i, layer in enumerate(shown):
            if elided and i == max_layers // 2:
                lines.append(f"  {'':>4}  ... {elided} more layers ...")
            lines.append(
                f"  {layer.index:>4}  {layer.name[:28]:<28} {layer.param_count:>14,} "
                f"{_fmt_flops(layer.fwd_flops):>11} {_fmt_bytes(layer.saved_bytes):>10} "
                f"{_fmt_bytes(layer.boundary_bytes):>10}"
            )
        if self.branches:
            lines.append("")
            kinds: dict[str, int] = {}
            for br in self.branches:
                kinds[br.kind] = kinds.get(br.kind, 0) + 1
            lines.append("  branches: " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())))
        return "\n".join(lines)

    # ---- JSON -----------------------------------------------------------
    def to_dict(self) -> dict:
        # without the module: asdict would deep-copy the whole GraphModule only to drop it
        d = dataclasses.asdict(dataclasses.replace(self, module=None))
        d.pop("module")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelGraph":
        version = d.get("format_version")
        if version != GRAPH_FORMAT_VERSION:
            raise ValueError(
                f"ModelGraph format_version {version!r} is not supported "
                f"(this meshplan reads version {GRAPH_FORMAT_VERSION}); capture the model again"
            )

        def tm(x):
            return TensorMeta(tuple(x["shape"]), x["dtype"])

        def tup(x):
            return tuple(tup(i) for i in x) if isinstance(x, list) else x

        nodes = tuple(
            OpInfo(**{**n,
                      "kind": OpKind(n["kind"]),
                      "attrs": tuple((k, tup(v)) for k, v in n.get("attrs", ())),
                      "inputs": tuple(n["inputs"]),
                      "param_names": tuple(n["param_names"]),
                      "input_meta": tuple(tm(t) for t in n["input_meta"]),
                      "output_meta": tuple(tm(t) for t in n["output_meta"])})
            for n in d["nodes"]
        )
        layers = tuple(
            Layer(**{**l, "nodes": tuple(l["nodes"]), "boundary": tuple(l["boundary"]),
                     "side_inputs": tuple(l["side_inputs"])})
            for l in d["layers"]
        )
        branches = tuple(
            Branch(**{**b, "paths": tuple(tuple(p) for p in b["paths"])}) for b in d["branches"]
        )
        return cls(model_class=d["model_class"], method=d["method"], batch_dim=d["batch_dim"],
                   batch_size=d["batch_size"], nodes=nodes, layers=layers, branches=branches,
                   fingerprint=d["fingerprint"], format_version=version,
                   shared_params=tuple(tuple(g) for g in d.get("shared_params", ())),
                   shared_numel=tuple(int(x) for x in d.get("shared_numel", ())),
                   random_ops=tuple(str(x) for x in d.get("random_ops", ())))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> "ModelGraph":
        """DocumentError (a ValueError) naming the file when it cannot be read as a JSON object."""
        return cls.from_dict(read_document(path, "captured graph file"))


def _fmt_flops(x: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} FLOP"


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"
