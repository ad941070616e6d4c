"""The plan's tensor split as codegen applies it to the stage graph (codegen/partition.py asks for it through
the registry's node-split lowering, Tensor.split_stage_graph): the split the plan stores, checked against its
config (or, for a version-1 plan, decided now as the planner decides it), with the output layer's
vocabulary padded where the execution asks for it (codegen/strategies/tensor/vocab.py), then applied
(codegen/strategies/tensor/split.py)."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from codegen.head import find_head
from codegen.stages import PartitionError
from codegen.strategies.tensor.split import TensorSplitResult, apply_splits
from codegen.strategies.tensor.vocab import output_rows_split, pad_splits
from planner.graph.model import ModelGraph
from planner.plan import Plan
from planner.strategies.tensor.split.analysis import tensor_splits
from planner.strategies.tensor.split.splits import TensorSplits


def split_stage_graph(plan: Plan, graph: ModelGraph, inputs: dict[str, Any], rewritten: fx.Graph | None = None,
                      attrs: dict[str, Any] | None = None) -> TensorSplitResult:
    """`graph.module`'s graph (or `rewritten`, a strategy's rewrite of it whose runtime attributes' meta
    stand-ins are `attrs`) split as `plan` decides, with the micro-batch's meta `inputs`.

    Raises PartitionError naming what the plan and its config disagree on, TensorSplitError where the split
    graph does not run."""
    gm = graph.module
    splits = head_splits(plan, gm, rewritten, plan_splits(plan, graph))
    return apply_splits(gm, splits, inputs, graph=rewritten, attrs=attrs)


def plan_splits(plan: Plan, graph: ModelGraph) -> TensorSplits | None:
    """The plan's tensor-parallel split (TensorSplits, or None at tensor 1), checked against its config."""
    cfg, splits = plan.config, plan.tensor_splits
    t = cfg.tensor
    if splits is None and t > 1:   # a version-1 plan: decide the split as the planner does now
        splits = tensor_splits(graph, dict(plan.shardings), t, cfg.sequence_parallel)
    if splits is not None and splits.tensor != t:
        raise PartitionError(f"the plan's tensor-parallel split is for tensor {splits.tensor}, its config has "
                             f"tensor {t}; make the plan again")
    if splits is not None and (splits.sequence is not None) != cfg.sequence_parallel:
        raise PartitionError(f"the plan's tensor-parallel split is {'with' if splits.sequence else 'without'} "
                             f"sequence parallelism, its config has sequence_parallel={cfg.sequence_parallel}; "
                             "make the plan again")
    return splits


def head_splits(plan: Plan, gm: fx.GraphModule, rewritten: fx.Graph | None,
                splits: TensorSplits | None) -> TensorSplits | None:
    """`splits` with the output layer's vocabulary padded where the execution asks for it (codegen/head.py);
    PartitionError where the model has no output layer the options need."""
    ex, t = plan.execution, plan.config.tensor
    if not (ex.chunked or ex.vocab_multiple > 1):
        return splits
    site, why = find_head(rewritten if rewritten is not None else gm.graph, gm)
    if site is None:
        flag = "--loss-impl chunked" if ex.chunked else f"--vocab-multiple {ex.vocab_multiple}"
        raise PartitionError(f"{flag} needs a model whose output is a final linear layer's, but {why}; "
                             f"leave {flag.split()[0]} out")
    if t > 1 and ex.vocab_multiple > 1:
        vsplit = output_rows_split(splits, site)
        if vsplit is None:
            raise PartitionError(f"--vocab-multiple {ex.vocab_multiple} at tensor {t}: the plan does not split "
                                 f"the output layer ({site.weight}) over the vocabulary, so nothing pads it; "
                                 "leave --vocab-multiple out")
        splits = pad_splits(splits, vsplit, ex.vocab_multiple)
    return splits
