"""The graph side of the activation-memory model (cost_models/activations.py).

Each captured op becomes an `OpView`: its activation inputs with views resolved to the
tensor they alias (q, k and v sliced from one QKV output are one tensor), attention
scores marked (the outputs of a product of two activations, QK^T, and of the ops after it
up to the product that consumes them, attention over V), and the tensor-parallel split
each tensor has under a config's roles. `SavedActivations.layer` adds up what a layer keeps
under the config's recompute mode (Korthikanti et al. 2022, sections 4-5).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.activations import (OpView, SavedTensor, SelectivePolicy, TensorRef, keep, layer_bytes, normalize,
                                    saved_by)
from planner.config import ParallelConfig
from planner.graph.model import Layer, ModelGraph, OpInfo
from planner.strategies.base import GraphSplits
from runtime.vocab import DType, OpKind, RecomputeMode, ShardRole

# roles whose output stays split over the tensor ranks (a row-parallel op's output is all-reduced)
_SPLIT_OUTPUT = (ShardRole.COLUMN, ShardRole.COLUMN_OUT, ShardRole.INNER, ShardRole.CHANNELS)
_NOT_ACTIVATIONS = (OpKind.PARAM, OpKind.SCALAR)  # get_attr buffers and non-tensor values


@dataclass(frozen=True)
class LayerActivations:
    """One layer on one rank for one micro-batch: `kept` bytes stay saved until its backward,
    `working` bytes are materialized again while its backward runs (recomputation), and the
    forward of the nodes in `recomputed` runs again in backward."""

    kept: float
    working: float
    recomputed: frozenset[str]


class SavedActivations:
    """What each op of one graph keeps for backward; see module docstring."""

    def __init__(self, graph: ModelGraph, sharding: GraphSplits, fp32_values: frozenset[str] = frozenset()) -> None:
        """`fp32_values`: the values a mixed-precision run holds in fp32 (cost_models/autocast.py: under
        torch.autocast, a residual stream fed by an fp32 embedding, a norm's output); they are kept 4 bytes
        an element, and an autocast-lowered op reading one keeps its 16-bit copy."""
        self._fp32 = fp32_values
        self._nodes = {n.name: n for n in graph.nodes}
        self._sharding = sharding
        self._batch = graph.batch_size
        self._root: dict[str, str] = {}
        self._scores: set[str] = set()
        self._node_cache: dict[tuple, float] = {}
        for n in graph.nodes:
            ins = self._activation_inputs(n)
            first = ins[0] if ins else None
            self._root[n.name] = self._root[first] if n.kind == OpKind.VIEW and first is not None else n.name
            float_ins = [i for i in ins if _is_float(self._nodes[i])]
            if any(i in self._scores for i in ins):
                if n.kind != OpKind.MATMUL:     # attention over V ends the scores
                    self._scores.add(n.name)
            elif n.kind == OpKind.MATMUL and len(float_ins) >= 2 and _rank(n) >= 3:
                self._scores.add(n.name)        # QK^T

    def _activation_inputs(self, n: OpInfo) -> list[str]:
        return [i for i in n.inputs if self._nodes[i].kind not in _NOT_ACTIVATIONS and self._nodes[i].output_meta]

    def _split(self, name: str, roles: dict[str, str], t: int) -> float:
        role = roles.get(name)
        return self._sharding.roles[name].divisor(t) if t > 1 and role in _SPLIT_OUTPUT else 1.0

    def _ref(self, name: str, roles: dict[str, str], t: int, mixed: bool = False) -> TensorRef:
        meta = self._nodes[name].output_meta[0]
        root = self._root[name]
        return TensorRef(key=root, shape=meta.shape, dtype=meta.dtype, split=self._split(root, roles, t),
                         score=name in self._scores, storage=self._nodes[root].output_meta[0].numel,
                         run_fp32=mixed and root in self._fp32)

    def op_view(self, n: OpInfo, roles: dict[str, str], t: int, mixed: bool = False) -> OpView:
        """`n` for the activation rules, under `roles` (the layer's split roles) on `t` tensor ranks;
        `mixed`: a 16-bit compute dtype (the fp32 values then hold 4 bytes an element)."""
        base = normalize(n.target)
        p = n.attr("p") if n.attr("p") is not None else n.attr("dropout_p")
        if p is None and "dropout" in base:
            p = n.attr("arg1")   # F.dropout(x, p, ...) records p positionally
        params = bool(n.param_count) or any(self._nodes[i].kind == OpKind.PARAM for i in n.inputs)
        own = roles.get(n.name)
        return OpView(
            name=n.name, kind=n.kind, base=base,
            inputs=tuple(self._ref(i, roles, t, mixed) for i in self._activation_inputs(n)),
            output=self._ref(n.name, roles, t, mixed) if n.output_meta else None,
            dropout_p=float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else 0.0,
            params=params,
            split=self._sharding.roles[n.name].divisor(t) if own is not None and t > 1 else 1.0,
            captured=n.saved_bytes,
        )

    def node_bytes(self, n: OpInfo, config: ParallelConfig, *, fused_attention: bool, divisor: float) -> float:
        """What `n` alone keeps for one micro-batch under `config`'s dtype and recompute mode (the
        attention core left out under selective recomputation), divided by `divisor` (its tensor split):
        the per-op figure the tensor-parallel and sub-graph choices weigh."""
        key = (n.name, config.dtype, config.recompute == RecomputeMode.SELECTIVE, fused_attention)
        kept = self._node_cache.get(key)
        if kept is None:   # the search prices every node under many configs: once per dtype and mode
            saved = saved_by(self.op_view(n, {}, 1, config.dtype != DType.FP32), fused_attention)
            kept = self._node_cache[key] = layer_bytes(list(saved), DType(config.dtype).bytes,
                                                       selective=key[2]).kept
        return kept * config.micro_batch_size / self._batch / divisor

    def layer(self, layer: Layer, roles: dict[str, str], config: ParallelConfig, *, ranks: int, sequence: int,
              fused_attention: bool, layer_input: float,
              policy: SelectivePolicy = SelectivePolicy.ATTENTION_CORE) -> LayerActivations:
        """`layer`'s activations under `config` (micro-batch, dtype, recompute), its split `roles` spread over
        `ranks` ranks (Strategy.split_ranks), the values between split regions divided by `sequence`
        (Strategy.sequence_ranks); `layer_input`: bytes of its input for one micro-batch, whole, the one
        tensor full recomputation keeps; `policy`: what selective recomputation keeps of a block."""
        t = ranks
        scale = config.micro_batch_size / self._batch
        mixed = config.dtype != DType.FP32
        views = [self.op_view(self._nodes[name], roles, t, mixed) for name in layer.nodes]
        per_op = [saved_by(v, fused_attention) for v in views]
        selective = config.recompute == RecomputeMode.SELECTIVE
        total = layer_bytes([s for saved in per_op for s in saved], DType(config.dtype).bytes, sequence,
                            selective=selective)
        if config.recompute == RecomputeMode.FULL:
            return LayerActivations(kept=layer_input / sequence, working=total.total * scale,
                                    recomputed=frozenset(layer.nodes))
        if selective and policy is SelectivePolicy.ALTERNATE_MATMULS and any(v.kind == OpKind.ATTENTION for v in views):
            kept = _alternate_matmuls(views, fused_attention)
            again = frozenset(layer.nodes) - {s.key for s in kept}
            kept_bytes = layer_bytes(kept, DType(config.dtype).bytes, sequence).total
            return LayerActivations(kept=layer_input / sequence + kept_bytes * scale, working=total.total * scale,
                                    recomputed=again)
        if selective and total.core:
            # the forward of the ops that produce or keep the dropped tensors runs again
            again = frozenset(v.name for v, saved in zip(views, per_op)
                              if v.name in self._scores or any(s.core for s in saved))
            return LayerActivations(kept=total.kept * scale, working=total.core * scale, recomputed=again)
        return LayerActivations(kept=total.kept * scale, working=0.0, recomputed=frozenset())


def _alternate_matmuls(views: list[OpView], fused_attention: bool) -> list[SavedTensor]:
    """What torchtitan's per-op selective checkpointing saves inside a block (SelectivePolicy.ALTERNATE_MATMULS):
    the outputs of the 1st, 3rd, ... linear layer in forward order (each one aten.mm) and the attention
    kernel's output with its row statistics."""
    kept, products = [], 0
    for v in views:
        if v.kind == OpKind.LINEAR and v.output is not None:
            products += 1
            if products % 2:
                kept.append(keep(v.output))
        elif v.kind == OpKind.ATTENTION:
            kept.extend(s for s in saved_by(v, fused_attention) if s.core)
    return kept


def _is_float(n: OpInfo) -> bool:
    return bool(n.output_meta) and n.output_meta[0].dtype.startswith(("float", "bfloat"))


def _rank(n: OpInfo) -> int:
    return len(n.output_meta[0].shape) if n.output_meta else 0
