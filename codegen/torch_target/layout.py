"""`TorchLayout`: a plan said in PyTorch's parallel vocabulary (DeviceMesh, tensor-parallel styles,
FSDP2, activation checkpointing), derived once from the plan and its captured graph.

`torch_layout(plan, graph)` is the one derivation that both `planner.parallelize` (applied at once
by runtime/torch_stack) and the generated torch script (written out as explicit calls) use. The
layout is plain data: frozen records with a JSON round trip, enums where a choice is made; the apply
side (runtime/torch_stack) takes its `to_dict()` and never imports codegen.

Tensor parallelism comes from the plan's `tensor_splits` (planner/strategies/tensor/split/splits.py), by module
path: every module whose weight the plan splits gets a style, chosen from the role the plan gave the
op that reads the weight (runtime.vocab.ShardRole):
  COLUMN      -> COLWISE (torch's ColwiseParallel: output features in contiguous blocks), or
                 COLWISE_STRIDED when the split is not one contiguous block: a fused projection such as
                 GPT's qkv (C -> 3C), whose FeatureSplit (3, H, D) on H gives rank r q_r, k_r and v_r;
                 it is sharded with the DTensor placement _StridedShard(0, split_factor=groups), which
                 means exactly that (groups = 3: the 3 equal parts are each split into t blocks).
  COLUMN_OUT  -> OUTPUT_COLWISE: the last projection split on the vocabulary, its logits gathered
                 (Replicate) so that the user's loss sees the whole vocabulary.
  ROW         -> ROWWISE (RowwiseParallel: input features split, output all-reduced).
  VOCAB       -> EMBEDDING_ROWWISE (RowwiseParallel on nn.Embedding: table rows split by vocabulary).
With sequence parallelism (Korthikanti et al. 2022, section 4.2.2) the norms between regions run on
this rank's block of the sequence (SEQUENCE: torch's SequenceParallel); the columns of a region take a
sequence-split input, rows and vocabulary embeddings give one (the module's `dim`; a column after the
sequence was gathered, BERT's decoder, takes its input whole); a replicated module
whose output meets the split activation (GPT's position table) is cut to this rank's tokens
(SEQUENCE_SCATTER, its output dimension in `dim`), and one that reads a split activation whole
(BERT's prediction head) gathers it (SEQUENCE_GATHER, `dim` the input's sequence dimension).

Data parallelism (ZeRO stage of the plan): 0 -> REPLICATE (torch's FSDP-based `replicate`: parameters
and optimizer state whole, gradients all-reduced and averaged), 3 -> FULLY_SHARD per block then the root,
resharding after forward; 1 and 2 -> FULLY_SHARD with reshard_after_forward=False (parameters stay
gathered from forward to backward, gradients reduce-scattered: ZeRO-2; torch has no stage that shards
only the optimizer state, so ZeRO-1 runs as ZeRO-2, which holds less). The blocks are the plan's
repeated layers that hold matrix products (the transformer blocks).

A fused projection split by parts (COLWISE_STRIDED) is refused under fully_shard: FSDP2 cuts the rank's
[q_r, k_r, v_r] into contiguous pieces that no DTensor placement describes.

RecomputeMode: "full" -> every block under torch.utils.checkpoint (checkpoint_wrapper); "selective" ->
the same blocks under a selective-checkpoint policy that keeps the matmul outputs and recomputes the
rest (the softmax, norms and elementwise work; torch.utils.checkpoint.create_selective_checkpoint_contexts),
the closest torch offers to Megatron's selective recompute.
"""

from __future__ import annotations

from collections import Counter

from codegen.strategies import registry
from codegen.torch_target.pipeline import pipeline_layout
# the records, importable from here as before
from codegen.torch_target.records import DataLayout, MeshDim, ModuleStyle, TorchLayout, TorchLayoutError  # noqa: F401
from planner.binding import graph_mismatch
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.torch_stack.vocab import DataKind, TensorStyle
from runtime.vocab import MeshAxis, OpKind, RecomputeMode, default_mesh_order

# Axes the torch target builds, the default mesh's; the others (spatial tiles, sub-graph sub-grids,
# context rings) have no torch counterpart here.
_TORCH_AXES = default_mesh_order()
# OpInfo kinds of a block's matrix products
_MATMUL_KINDS = (OpKind.LINEAR, OpKind.MATMUL, OpKind.ATTENTION, OpKind.CONV)


def torch_layout(plan: Plan, graph: ModelGraph) -> TorchLayout:
    """The torch layout of `plan` on its captured `graph`; TorchLayoutError if torch cannot express it."""
    mismatch = graph_mismatch(plan, graph)
    if mismatch:
        raise TorchLayoutError(f"{mismatch}; capture the model the plan was made for")
    cfg = plan.config
    for axis, size in plan.mesh.items():
        if size > 1 and MeshAxis(axis) not in _TORCH_AXES:
            raise TorchLayoutError(f"the torch target has no {axis} axis (the plan's {axis} degree is {size}); "
                                   f"plan with optimize(..., target='torch') or run it with meshplan's runtime")
    pipeline = pipeline_layout(plan, graph)
    mesh = tuple(MeshDim(MeshAxis(a), n) for a, n in plan.mesh.items() if n > 1)
    # A pipeline stage's code calls the blocks' parts, never a block's forward, so fully_shard units and
    # checkpoint wrappers on the blocks would not run: the stage module is the one fully_shard unit, and
    # recomputation is written into the stage code (codegen/partition.py).
    blocks = _blocks(plan, graph) if pipeline is None else ()
    # the split modules' styles, from the strategy that splits them (codegen/strategies/tensor/torch_styles.py)
    found = [x for s in registry.active(plan) if (x := s.torch_styles(plan, graph)) is not None]
    tensor, sequence_dim = found[0] if found else ((), None)
    data = _data_layout(cfg.data, cfg.zero, blocks)
    strided = [s.path for s in tensor if s.style is TensorStyle.COLWISE_STRIDED]
    if strided and data.kind is DataKind.FULLY_SHARD:
        # fully_shard cuts a rank's [q_r, k_r, v_r] into contiguous halves, a shard no DTensor placement
        # describes: training would run, but the whole parameter (full_tensor, state_dict, DCP) would not
        raise TorchLayoutError(f"module {strided[0]!r}: a fused projection split by parts (q_r, k_r, v_r) cannot "
                               f"also be sharded by fully_shard (ZeRO {cfg.zero}); plan it with ZeRO 0, or write "
                               f"the projections as separate Linears")
    return TorchLayout(
        mesh=mesh or (MeshDim(MeshAxis.DATA, 1),),
        tensor=tensor,
        sequence_dim=sequence_dim,
        data=data,
        recompute=RecomputeMode(cfg.recompute),
        checkpoint_units=() if cfg.recompute == RecomputeMode.NONE else blocks,
        ties=tuple(tuple(g) for g in graph.shared_params),
        pipeline=pipeline,
    )


def _data_layout(data: int, zero: int, blocks: tuple[str, ...]) -> DataLayout:
    if data == 1:
        return DataLayout(DataKind.NONE)
    if zero == 0:
        return DataLayout(DataKind.REPLICATE)
    return DataLayout(DataKind.FULLY_SHARD, reshard_after_forward=zero == 3, units=blocks)


def _blocks(plan: Plan, graph: ModelGraph) -> tuple[str, ...]:
    """The plan's blocks, in model order: its repeated layers that are modules and hold matrix products
    (the transformer blocks; a LayerNorm layer that happens to repeat, as BERT's do, is not one)."""
    layers = [name for stage in plan.stages for name in stage.layers]
    by_name = {layer.name: layer for layer in graph.layers}
    kinds = {n.name: n.kind for n in graph.nodes}
    repeats = Counter(by_name[name].signature for name in layers)
    paths = {n.module_path for n in graph.nodes}
    return tuple(name for name in layers if repeats[by_name[name].signature] > 1
                 and any(kinds[n] in _MATMUL_KINDS for n in by_name[name].nodes)
                 and any(p == name or p.startswith(name + ".") for p in paths))
