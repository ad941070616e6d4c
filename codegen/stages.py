"""What cutting a plan's graph into pipeline stages produces and shares (codegen/partition.py cuts it):
each stage's part (`StagePart`), the whole `Partition`, the `StageCut` the strategies' stage-code makers
read, and the signatures of their hooks. Kept apart from the cutting so that the strategies' codegen
modules, which the cutting calls through the registry, import only these types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from codegen.stage_parts import StageCodePart
from runtime.spec import Boundary, StageSpec

GraphRewrite = Callable[[fx.GraphModule, dict[str, Any]], tuple[fx.Graph, dict[str, Any]]]
# a strategy's maker of its parts of the stages' code: the cut -> {stage index: its StageCodePart}
StageCodeMaker = Callable[["StageCut"], dict[int, StageCodePart]]


class PartitionError(ValueError):
    """The plan cannot be cut into stage modules; the message names the layer or value."""


@dataclass(frozen=True)
class StagePart:
    """One stage: its runtime spec, generated class, and local parameters.

    params: (name, local shape, dtype) of the stage module's trainable parameters, in
    the order gradients become ready in backward (last layer first).
    """

    spec: StageSpec
    device_index: int
    class_name: str
    source: str
    globals: dict
    params: tuple[tuple[str, tuple[int, ...], str], ...]


@dataclass(frozen=True)
class Partition:
    stages: tuple[StagePart, ...]
    tensor: int
    micro_batch_size: int
    signature: str
    tensor_shapes: dict          # model tensor name -> full shape (for mismatch messages)


@dataclass
class StageCut:
    """Where the split graph is cut: each node's layer and stage, the values crossing into each stage, and
    the local (this rank's) and full values that boundaries are described from. The strategies' stage-code
    makers read it: `res.graph` (the split graph), `res.local_values` (node name -> this rank's meta value),
    `layer_of`, `stage_of`, `stage_of_layer`, `known` and `stages`."""

    res: Any                              # apply_splits' result: the graph, shards, local and full values
    nodes: list[fx.Node]
    pos: dict[str, int]                   # node name -> position in the graph
    layer_of: dict[str, str]              # node name -> layer name
    stage_of: dict[str, int]              # node name (not get_attr) -> stage index
    stage_of_layer: dict[str, int]
    known: list[str]                      # layer names, in model order
    crossing: dict[int, list[fx.Node]]    # stage s -> values made before s and read at s or later
    placeholders: list[str]               # the model inputs, in order
    head: Any
    head_extra: tuple
    padded_names: tuple

    @property
    def stages(self) -> range:
        """The stage indices."""
        return range(len(self.crossing))

    def boundary(self, n: fx.Node, source: str, data_index: int = -1) -> Boundary:
        """The Boundary of value `n` entering or leaving a stage (`source`: "data", "recv" or "send")."""
        v = self.res.local_values[n.name]
        if not isinstance(v, torch.Tensor):
            raise PartitionError(f"value {n.name!r} ({type(v).__name__}) crosses a pipeline cut; only tensors can "
                                 "be sent between stages. Choose other stage boundaries.")
        key = str(n.target).lstrip("*") if source == "data" else ""
        return Boundary(n.name, tuple(v.shape), str(v.dtype).removeprefix("torch."),
                        bool(self.res.full_values[n.name].requires_grad and v.is_floating_point()), source,
                        data_index, key)
