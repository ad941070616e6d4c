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
from dataclasses import dataclass, field

from codegen.torch_target.pipeline import pipeline_layout
from planner.binding import graph_mismatch
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.program.shards import FeatureSplit
from runtime.torch_stack.pipeline_layout import PipelineLayout
from runtime.torch_stack.vocab import DataKind, TensorStyle
from runtime.vocab import MeshAxis, OpKind, RecomputeMode, ShardRole

# Axes the torch target builds; the others (spatial tiles, sub-graph sub-grids, context rings) have
# no torch counterpart here.
_TORCH_AXES = (MeshAxis.PIPELINE, MeshAxis.DATA, MeshAxis.TENSOR)
# OpInfo kinds of a block's matrix products
_MATMUL_KINDS = (OpKind.LINEAR, OpKind.MATMUL, OpKind.ATTENTION, OpKind.CONV)


class TorchLayoutError(ValueError):
    """A plan the torch target cannot express; the message names the axis or module and what to do."""


@dataclass(frozen=True)
class MeshDim:
    """One dimension of the DeviceMesh: its axis name and size (devices)."""

    axis: MeshAxis
    size: int


@dataclass(frozen=True)
class ModuleStyle:
    """The tensor-parallel style of the module at `path`.

    groups: for COLWISE_STRIDED, the equal parts of the output features each split into t blocks
        (3 for a fused qkv), else 1.
    dim: under sequence parallelism, the sequence dimension split at a column's input (the columns of a
        region; BERT's decoder, after the head gathered the sequence, has None), at a row's or vocabulary
        embedding's output, at a SEQUENCE_SCATTER module's output or a SEQUENCE_GATHER module's input;
        else None.
    """

    path: str
    style: TensorStyle
    groups: int = 1
    dim: int | None = None


@dataclass(frozen=True)
class DataLayout:
    """Data parallelism: the wrapper, whether fully_shard frees gathered parameters after forward, and
    the module paths wrapped one by one before the root (the plan's blocks, in model order)."""

    kind: DataKind
    reshard_after_forward: bool = True
    units: tuple[str, ...] = ()


@dataclass(frozen=True)
class TorchLayout:
    """A plan in torch's vocabulary (see the module docstring).

    mesh: the DeviceMesh dimensions, outermost first (ranks row-major, last dimension fastest, as
        meshplan lays them out: runtime/program/mesh.py).
    tensor: the style of every tensor-parallel module, in graph order.
    sequence_dim: the activations' sequence dimension under sequence parallelism, else None.
    data: the data-parallel wrapper.
    recompute: activation recomputation; `checkpoint_units` the module paths it wraps.
    ties: groups of parameter names that are one parameter (tied embeddings), canonical name first;
        the apply side ties them again after the styles replaced the parameters.
    pipeline: the pipeline layout (codegen/torch_target/pipeline.py) or None for plans without one.
    """

    mesh: tuple[MeshDim, ...]
    tensor: tuple[ModuleStyle, ...] = ()
    sequence_dim: int | None = None
    data: DataLayout = field(default_factory=lambda: DataLayout(DataKind.NONE))
    recompute: RecomputeMode = RecomputeMode.NONE
    checkpoint_units: tuple[str, ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()
    pipeline: PipelineLayout | None = None

    @property
    def world_size(self) -> int:
        out = 1
        for d in self.mesh:
            out *= d.size
        return out

    def style_of(self, path: str) -> ModuleStyle | None:
        """The style of the module at `path`, or None if it is not tensor-parallel."""
        return next((s for s in self.tensor if s.path == path), None)

    def to_dict(self) -> dict:
        return {
            "mesh": [[str(d.axis), d.size] for d in self.mesh],
            "tensor": [{"path": s.path, "style": str(s.style), "groups": s.groups, "dim": s.dim} for s in self.tensor],
            "sequence_dim": self.sequence_dim,
            "data": {"kind": str(self.data.kind), "reshard_after_forward": self.data.reshard_after_forward,
                     "units": list(self.data.units)},
            "recompute": str(self.recompute),
            "checkpoint_units": list(self.checkpoint_units),
            "ties": [list(t) for t in self.ties],
            "pipeline": None if self.pipeline is None else self.pipeline.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TorchLayout":
        pipeline = None
        if d.get("pipeline") is not None:
            pipeline = PipelineLayout.from_dict(d["pipeline"])
        data = d["data"]
        return cls(
            mesh=tuple(MeshDim(MeshAxis(a), int(n)) for a, n in d["mesh"]),
            tensor=tuple(ModuleStyle(s["path"], TensorStyle(s["style"]), int(s["groups"]),
                                     None if s["dim"] is None else int(s["dim"])) for s in d["tensor"]),
            sequence_dim=None if d["sequence_dim"] is None else int(d["sequence_dim"]),
            data=DataLayout(DataKind(data["kind"]), bool(data["reshard_after_forward"]), tuple(data["units"])),
            recompute=RecomputeMode(d["recompute"]),
            checkpoint_units=tuple(d["checkpoint_units"]),
            ties=tuple(tuple(t) for t in d["ties"]),
            pipeline=pipeline,
        )


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
    tensor, sequence_dim = _tensor_styles(plan, graph) if cfg.tensor > 1 else ((), None)
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


def _tensor_styles(plan: Plan, graph: ModelGraph) -> tuple[tuple[ModuleStyle, ...], int | None]:
    """Styles by module path (graph order) and the sequence dimension under sequence parallelism."""
    ts = plan.tensor_splits
    if ts is None and not plan.shardings:   # a tensor axis that splits nothing: its ranks compute alike
        return (), None
    if ts is None:
        raise TorchLayoutError("the plan has tensor degree > 1 but no tensor split (a version-1 plan file); "
                               "make the plan again with this meshplan")
    t = ts.tensor
    by_path = {m.path: m for m in ts.modules}
    by_param = {p.name: p for p in ts.params}
    aliases = {name: group for group in graph.shared_params for name in group}
    seq = ts.sequence
    split_at = set() if seq is None else {*seq.columns, *seq.starts}   # nodes whose input / output is split
    sequence_dim = None if seq is None else next((m.sequence_dim for m in ts.modules if m.sequence_dim is not None), 1)
    styles: dict[str, ModuleStyle] = {}
    for node in graph.nodes:
        if node.kind not in (OpKind.LINEAR, OpKind.EMBEDDING):
            continue
        path = node.module_path
        role = plan.role(node.name)
        if path in by_path:
            split = by_path[path].split
        else:
            names = {path + ".weight", *node.param_names}
            names |= {a for n in tuple(names) for a in aliases.get(n, ())}
            weights = [by_param[n] for n in sorted(names) if n in by_param and not n.endswith(".bias")]
            if not weights:
                continue
            split = weights[0].split
        if role == ShardRole.REPLICATE:
            continue
        styles[path] = ModuleStyle(path, _style(path, node.kind, ShardRole(role), split, t), split.groups,
                                   sequence_dim if node.name in split_at else None)
    if seq is not None:
        _add_sequence_styles(plan, graph, styles, sequence_dim)
    return tuple(styles.values()), sequence_dim


def _style(path: str, kind: OpKind, role: ShardRole, split: FeatureSplit, t: int) -> TensorStyle:
    groups = split.groups
    if kind == OpKind.EMBEDDING:
        if role == ShardRole.VOCAB and groups == 1:
            return TensorStyle.EMBEDDING_ROWWISE
        raise TorchLayoutError(f"module {path!r}: an embedding split as {role} ({split}) has no torch style; "
                               f"plan without tensor parallelism on it")
    if role == ShardRole.COLUMN:
        return TensorStyle.COLWISE if groups == 1 else TensorStyle.COLWISE_STRIDED
    if role == ShardRole.COLUMN_OUT and groups == 1:
        return TensorStyle.OUTPUT_COLWISE
    if role == ShardRole.ROW and groups == 1:
        return TensorStyle.ROWWISE
    raise TorchLayoutError(f"module {path!r}: a {role} split over {t} ranks as {split} (not one contiguous block "
                           f"per rank) has no torch style; write the model's projections unfused")


def _add_sequence_styles(plan: Plan, graph: ModelGraph, styles: dict[str, ModuleStyle], dim: int) -> None:
    """SEQUENCE for the norms between regions, SEQUENCE_SCATTER / SEQUENCE_GATHER where a replicated
    module meets the split activation."""
    seq = plan.tensor_splits.sequence
    nodes = {n.name: n for n in graph.nodes}
    for name in seq.params:   # module paths (fx) or parameter names (ATen captures)
        path = name if any(n.module_path == name for n in graph.nodes) else name.rsplit(".", 1)[0]
        styles.setdefault(path, ModuleStyle(path, TensorStyle.SEQUENCE))
    for _, value, value_dim in seq.scatters:
        path = _module_of(nodes[value], "a replicated input cut to the sequence block")
        styles.setdefault(path, ModuleStyle(path, TensorStyle.SEQUENCE_SCATTER, dim=value_dim))
    for consumer, _ in seq.gathers:
        path = _module_of(nodes[consumer], "a consumer reading the whole sequence")
        styles.setdefault(path, ModuleStyle(path, TensorStyle.SEQUENCE_GATHER, dim=dim))


def _module_of(node, what: str) -> str:
    if not node.module_path:
        raise TorchLayoutError(f"node {node.name!r} ({what}) belongs to no module, so no torch style can hold it; "
                               f"plan without sequence parallelism")
    return node.module_path
