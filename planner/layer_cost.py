"""`LayerCost`: one layer on one device for one micro-batch, as the Evaluator prices it and the
strategies adjust it (planner/strategies/base.py's layer_cost hook). A module of its own so that the
strategies read the type without importing the Evaluator, which imports them."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class AxisComm:
    """Seconds of the collectives one mesh axis (a runtime.vocab.MeshAxis value) runs inside a layer, on one
    device for one micro-batch: they block the layer (the tensor axis's all-reduces, the spatial axis's
    halos, the context axis's ring, the sub-graph axis's broadcasts). `backward` includes a recomputed
    forward's."""

    axis: str
    forward: float
    backward: float


def comm_on(comm: tuple[AxisComm, ...], axis: str) -> AxisComm:
    """The entry of `comm` for mesh axis `axis`, or zero seconds where it has none."""
    return next((c for c in comm if c.axis == axis), AxisComm(axis, 0.0, 0.0))


@dataclass(frozen=True)
class LayerCost:
    """One layer on one device for one micro-batch. Seconds and bytes."""

    forward: float          # compute only
    backward: float         # compute only
    recompute: float        # extra forward work in backward (per recompute mode)
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
    # the in-layer collectives, one entry per mesh axis that runs any, in the order the strategies added them
    comm: tuple[AxisComm, ...] = ()

    @property
    def comm_forward(self) -> float:
        """Seconds of in-layer collectives in forward, on every axis (they block the layer)."""
        return sum((c.forward for c in self.comm), 0.0)

    @property
    def comm_backward(self) -> float:
        """Seconds of in-layer collectives in backward, on every axis."""
        return sum((c.backward for c in self.comm), 0.0)

    def on(self, axis: str) -> AxisComm:
        """The in-layer collectives on mesh axis `axis` (zero seconds where it runs none)."""
        return comm_on(self.comm, axis)

    def with_comm(self, axis: str, forward: float, backward: float) -> "LayerCost":
        """This cost with `axis`'s in-layer collectives set to (forward, backward) seconds (an axis already
        listed keeps its place)."""
        entry = AxisComm(axis, forward, backward)
        if any(c.axis == axis for c in self.comm):
            return replace(self, comm=tuple(entry if c.axis == axis else c for c in self.comm))
        return replace(self, comm=(*self.comm, entry))

    def comm_divided(self, by: float) -> "LayerCost":
        """This cost with every axis's in-layer collectives divided by `by` (ranks sharing the tokens)."""
        return replace(self, comm=tuple(AxisComm(c.axis, c.forward / by, c.backward / by) for c in self.comm))


__all__ = ["AxisComm", "LayerCost", "comm_on"]
