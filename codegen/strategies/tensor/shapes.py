"""The tensor split's local shapes in the generated code (used by codegen.strategies.tensor.split): the graph
is re-run at one rank's sizes (codegen/local_shapes.py) with each split module replaced by its local
stand-in, made from the plan's split description (local_modules.py), and the stage's tensor group by a
shape-only stand-in, and shape constants holding a full size of a split dimension become the local size.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn

from codegen.local_shapes import ShapeRewriteError, rewrite_local
from codegen.strategies.tensor.local_modules import local_module
from planner.strategies.tensor.split.rules import TensorSplitError
from runtime.materialize import TENSOR_GROUP
from runtime.program.shards import ModuleShard
from runtime.parallel.tensor.layers import ShapeGroup


def _local_modules(gm: fx.GraphModule, shards: dict[str, ModuleShard], t: int) -> dict[str, nn.Module]:
    return {path: local_module(gm.get_submodule(path), sh, t) for path, sh in shards.items()}


def _rewrite(gm, graph: fx.Graph, shards, value_splits, t, inputs, full, attrs=None) -> dict[str, Any]:
    """rewrite_local with the split modules' local shards and the tensor group's stand-in; TensorSplitError."""
    stand_ins = {TENSOR_GROUP: ShapeGroup(t)} if t > 1 else None
    try:
        return rewrite_local(gm, graph, _local_modules(gm, shards, t), value_splits, t, inputs, full, attrs, stand_ins)
    except ShapeRewriteError as e:
        raise TensorSplitError(str(e)) from None
