"""The torch target's tensor-parallel styles (codegen/torch_target/layout.py, whose docstring says what each
style means): from the plan's tensor split, by module path, the style of every module whose weight it
splits and, under sequence parallelism, the sequence dimension and the styles where a replicated module
meets the split activation. The tensor strategy's `torch_styles` hook (codegen/strategies/tensor/strategy.py)."""

from __future__ import annotations

from codegen.torch_target.records import ModuleStyle, TensorStyle, TorchLayoutError
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.program.shards import FeatureSplit
from runtime.vocab import OpKind, ShardRole


def tensor_styles(plan: Plan, graph: ModelGraph) -> tuple[tuple[ModuleStyle, ...], int | None]:
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
