"""`LayerCost`: one layer on one device for one micro-batch, as the Evaluator prices it and the
strategies adjust it (planner/strategies/base.py's layer_cost hook). A module of its own so that the
strategies read the type without importing the Evaluator, which imports them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCost:
    """One layer on one device for one micro-batch. Seconds and bytes."""

    forward: float          # compute only
    backward: float         # compute only
    recompute: float        # extra forward work in backward (per recompute mode)
    tp_forward: float       # tensor-parallel collectives in forward (and spatial halos, BatchNorm sync, gather)
    tp_backward: float      # ... in backward (and in the recomputed forward)
    subgraph_forward: float   # sub-graph collectives over the sub-grids in forward (planner/strategies/subgraph/strategy.py)
    subgraph_backward: float  # ... in backward
    saved: float            # activation bytes kept for backward (per recompute mode)
    working: float          # bytes materialized again while this layer's backward runs (recompute)
    params: float           # parameters held per device (count)
    largest_param_layer: float  # same as params (kept for ZeRO-3 gather buffers)
    temporary: float        # largest single output (+ its gradient) in bytes
    boundary: float         # bytes crossing the cut after this layer
    # On a GPU (0 elsewhere): host seconds dispatching the layer's ops (cost_models/gpu_node.py); of
    # forward/backward, the loss's part on the last layer (cost_models/step_costs.py) and its bytes at its
    # peak; the 16-bit weight copies autocast keeps per micro-batch; parameter tensors (optimizer launches).
    host_forward: float = 0.0
    host_backward: float = 0.0
    loss_forward: float = 0.0
    loss_backward: float = 0.0
    loss_peak: float = 0.0
    weight_copies: float = 0.0
    tensors: int = 0

    @property
    def comm_forward(self) -> float:
        """Seconds of in-layer collectives in forward (they block the layer)."""
        return self.tp_forward + self.subgraph_forward

    @property
    def comm_backward(self) -> float:
        """Seconds of in-layer collectives in backward."""
        return self.tp_backward + self.subgraph_backward
