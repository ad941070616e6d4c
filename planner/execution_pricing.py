"""How the Evaluator prices what the runtime's Execution (runtime/execution.py) changes beyond the nodes'
kernels: which layers a compiled build compiles, the output linear the fused chunked loss computes
itself, the loss as the execution runs it (full, compiled or fused chunked, over the tensor ranks'
vocabulary split where the output layer is split), the host's copies of each micro-batch
(cost_models/step_costs.py), and the same Evaluator pricing another Execution
(planner/execution_choice.py asks for each option).

`ExecutionPricing` is the part of planner/evaluator.py's Evaluator that does this, kept apart so each file
holds one concern; it reads the Evaluator's tables (graph, gpu_costs, gpu_graph, overlap, execution,
setup, _nodes, _logits, _logits_layer), calls its `split_divisor`, `split_ranks`, `split_seconds`,
`_token_share` and `gpu`, and `with_execution` empties its layer caches (the ones that depend on the execution).
"""

from __future__ import annotations

import copy
from typing import TypeVar

from cost_models.autocast import FLOAT32
from cost_models.step_costs import (LossCost, Work, chunked_loss_cost, compiled_loss_cost, full_loss_cost,
                                    prefetched_batch)
from planner.config import ParallelConfig
from planner.graph.model import Layer, ModelGraph
from runtime.execution import Execution, LossImpl
from runtime.vocab import Collective, DType, OpKind, ShardRole

E = TypeVar("E", bound="ExecutionPricing")   # the Evaluator, whose copy with_execution returns


class ExecutionPricing:
    """The Evaluator's pricing of its Execution (see module docstring)."""

    def _find_logits(self) -> str | None:
        """The node whose output the loss reads: the model output's first tensor, views resolved."""
        outs = [n for n in self.graph.nodes if n.kind == OpKind.OUTPUT and n.inputs]
        if not outs:
            return None
        name = outs[0].inputs[0]
        while self._nodes[name].kind == OpKind.VIEW and self._nodes[name].inputs:
            name = self._nodes[name].inputs[0]
        return name if self._nodes[name].output_meta else None

    def logits_node(self) -> str | None:
        """The node whose output the loss reads (views resolved), or None."""
        return self._logits

    def fused_head_candidate(self) -> str | None:
        """The output linear a fused chunked loss would compute itself, or None (the model's output is not
        a linear layer's)."""
        if self._logits is None:
            return None
        return self._logits if self._nodes[self._logits].kind == OpKind.LINEAR else None

    def with_execution(self: E, execution: Execution) -> E:
        """This Evaluator pricing `execution` instead (planner/execution_choice.py): what depends only on
        the graph and the cluster is shared, the layer costs are priced again."""
        other = copy.copy(self)
        other.execution = execution
        other._layer_cache, other._bounds_cache, other._costs_cache = {}, {}, {}
        return other

    def _fused_head(self, config: ParallelConfig) -> str | None:
        """The output linear the fused chunked loss computes itself, under this Evaluator's execution."""
        if self.gpu_costs is None or self.execution.loss != LossImpl.CHUNKED or self._logits is None:
            return None
        return self._logits if self._nodes[self._logits].kind == OpKind.LINEAR else None

    def _loss_cost(self, config: ParallelConfig, roles: dict[str, str]) -> LossCost | None:
        """The loss of one micro-batch on the rank holding the logits (a GPU; None elsewhere, or for a loss
        over a few values per sample)."""
        if self.gpu_costs is None or self._logits is None or self.setup.loss != "cross_entropy":
            return None
        n = self._nodes[self._logits]
        meta = n.output_meta[0]
        classes = meta.shape[-1] if meta.shape else 1
        role = roles.get(n.name, ShardRole.REPLICATE)
        div = self.split_divisor(n.name, role, config)
        tokens = meta.numel / max(classes, 1) * config.micro_batch_size / self.graph.batch_size / \
            self._token_share(n.name, role, config)
        gpu = self.gpu(config.dtype)
        parallel = self.split_ranks(config) if div > 1 else 1   # the ranks that hold the vocabulary's blocks

        def allreduce(nbytes: float) -> float:
            return self.split_seconds(config, Collective.ALL_REDUCE, nbytes)

        def gather(nbytes: float) -> float:
            return self.split_seconds(config, Collective.ALL_GATHER, nbytes)
        m = self.execution.vocab_multiple
        padded = -(-int(classes / div) // m) * m   # this rank's output rows, the padding included
        if self._fused_head(config) == n.name:
            return chunked_loss_cost(gpu, tokens, padded, n.input_meta[0].shape[-1],
                                     chunk_tokens=self.execution.loss_chunk_tokens, vocab_parallel=parallel,
                                     allreduce=allreduce, gather=gather)
        mixed = config.dtype != DType.FP32
        low = self.overlap.autocast is False or self.gpu_graph.dtypes.get(n.name) != FLOAT32
        width = 2 if mixed and low else 4
        if self.execution.compiled_loss and div == 1:   # codegen refuses it over a vocabulary split
            return compiled_loss_cost(gpu, tokens, classes, logits_bytes=width, held_vocab=padded)
        return full_loss_cost(gpu, tokens, classes / div, logits_bytes=width, vocab_parallel=parallel,
                              allreduce=allreduce)

    def _batch_copies(self, layer: Layer, config: ParallelConfig) -> Work:
        """Host-to-device copies of a micro-batch, the inputs before the first layer and the targets before
        the layer holding the logits: prefetched on a side stream by meshplan's runtime on a GPU, so only
        their host dispatch counts (cost_models/step_costs.prefetched_batch); nothing elsewhere."""
        if self.gpu_costs is None:
            return Work()
        gpu = self.gpu(config.dtype)
        work = Work()
        if layer.index == 0:
            work = work + prefetched_batch(gpu)
        if layer.index == self._logits_layer and self._logits is not None:
            work = work + prefetched_batch(gpu)
        return work


def compiled_layers(graph: ModelGraph) -> frozenset[int]:
    """The layers a build with compiled stages compiles (codegen/partition.py, regional compilation): the
    repeated blocks that hold parameters, or without any, every layer that holds parameters; the others
    run eager (a compiled region's call costs more than fusing a few views saves)."""
    signatures = [layer.signature for layer in graph.layers]
    weighty = {layer.index for layer in graph.layers if layer.param_count > 0}
    blocks = {layer.index for layer in graph.layers if signatures.count(layer.signature) > 1} & weighty
    return frozenset(blocks or weighty)


__all__ = ["ExecutionPricing", "compiled_layers"]
