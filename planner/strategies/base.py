"""The planner side of one parallel strategy: the hooks the Evaluator and the search call.

A `Strategy` is stateless; what it caches for one graph on one cluster lives in the
Evaluator (`Evaluator.state`). Every hook has a neutral default, so a strategy overrides
only what it changes. The registry (planner/strategies/registry.py) lists the strategies
in composition order: a strategy listed later refines the ones before it (its layer cost
adjustment runs after theirs, its stage bounds win over theirs, and the last active
`Placement` prices the step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from runtime.vocab import StrategyName

if TYPE_CHECKING:
    from cost_models.overlap import DeviceWork
    from cost_models.prediction import Prediction
    from planner.config import ParallelConfig
    from planner.evaluator import Evaluator, LayerCost
    from planner.graph.model import Layer

Bounds = list[tuple[int, int]]            # [lo, hi) layer ranges of the pipeline stages
Fits = Callable[[int, int, int], bool]    # fits(stage, lo, hi): layers [lo, hi) fit on that stage's device


@dataclass(frozen=True)
class MeshShape:
    """One data x tensor x pipeline shape the search considers, with what its configs share.

    micro_batch_sizes: the micro-batch sizes (samples) the constraints allow for this shape;
    max_micro_batch_size: their cap; num_layers: layers the pipeline can cut between;
    global_batch_size: samples per optimizer step.
    """

    data: int
    tensor: int
    pipeline: int
    micro_batch_sizes: tuple[int, ...]
    max_micro_batch_size: int
    dtype: str
    num_layers: int
    global_batch_size: int


class Strategy:
    """One parallel dimension, planner side (see module docstring)."""

    name: StrategyName
    named_at_one = False   # device-count messages name this degree even where it is 1

    def active(self, config: "ParallelConfig") -> bool:
        """Whether `config` uses this strategy: by default, whether its degree (the ParallelConfig field
        of the strategy's name) is above 1."""
        return getattr(config, self.name) > 1

    def mesh_factor(self, config: "ParallelConfig") -> tuple[str, int] | None:
        """(name, degree) of this strategy's factor of the device count, where it is worth naming."""
        degree = getattr(config, self.name)
        return (self.name, degree) if degree > 1 or self.named_at_one else None

    # ---- search -------------------------------------------------------------
    def pinned_on(self, constraints: dict) -> bool:
        """Whether the search constraints require this strategy (every candidate must use it)."""
        return False

    def shape_configs(self, shape: MeshShape, constraints: dict) -> list["ParallelConfig"]:
        """Configs of one mesh shape that this strategy adds to the search (schedules, replicas)."""
        return []

    def variants(self, ev: "Evaluator", num_devices: int, constraints: dict,
                 shapes_of: Callable[[int], list["ParallelConfig"]]) -> list["ParallelConfig"]:
        """Configs that give this strategy part of the `num_devices` devices; `shapes_of(n)` lists the
        plain data x tensor x pipeline configs of the n devices left."""
        return []

    # ---- pricing ------------------------------------------------------------
    def check(self, ev: "Evaluator", config: "ParallelConfig") -> None:
        """Raise ValueError naming what to change when `config` cannot run `ev`'s graph."""

    def node_roles(self, ev: "Evaluator", layer: "Layer", config: "ParallelConfig") -> dict[str, str]:
        """Split roles this strategy gives `layer`'s nodes (fx node name -> role; the rest replicated)."""
        return {}

    # True where layer_cost depends on the layer only through its signature (and `cost`, `config`): the
    # Evaluator then adjusts each distinct layer of a model's repeated blocks once per configuration
    layer_cost_by_signature: bool = False

    def layer_cost(self, ev: "Evaluator", layer: "Layer", cost: "LayerCost",
                   config: "ParallelConfig") -> "LayerCost":
        """`cost` (one layer, one device, one micro-batch) adjusted for this strategy."""
        return cost

    def stage_bounds(self, ev: "Evaluator", config: "ParallelConfig", costs: list["LayerCost"],
                     weights: list[float], fits: Fits | None) -> Bounds | None:
        """Stage bounds this strategy imposes (weights: seconds per layer), or None to leave them."""
        return None

    def grad_sync(self, ev: "Evaluator", config: "ParallelConfig", params: float, work: "DeviceWork",
                  m: int) -> tuple[float, float]:
        """(exposed seconds, on-path seconds) per step of this strategy's gradient and weight traffic for
        the device holding `params` parameters, whose compute per micro-batch (`work`, per layer and
        chunk) can hide it as the Evaluator's `overlap` allows."""
        return 0.0, 0.0


class Placement(Strategy, ABC):
    """A strategy that lays the pipeline stages on devices and prices the whole step (pipeline and
    its bi-directional refinement); the Evaluator asks the last active one."""

    @abstractmethod
    def stage_fits(self, ev: "Evaluator", config: "ParallelConfig", costs: list["LayerCost"],
                   global_batch_size: int) -> Fits | None:
        """The memory check the stage partition respects, or None where the bounds check memory themselves."""

    @abstractmethod
    def step(self, ev: "Evaluator", config: "ParallelConfig", global_batch_size: int, m: int,
             costs: list["LayerCost"], bounds: Bounds) -> "Prediction":
        """The step's Prediction: time breakdown, peak memory, per-stage costs."""

    @abstractmethod
    def lower_bound(self, ev: "Evaluator", config: "ParallelConfig", costs: list["LayerCost"], m: int,
                    slot: float) -> float:
        """Seconds per step that every recompute/ZeRO variant of `config` takes at least, given the
        average device's compute and in-layer communication per micro-batch (`slot` s)."""
