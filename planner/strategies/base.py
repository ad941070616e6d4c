"""The planner side of one parallel strategy: the hooks the Evaluator and the search call.

A `Strategy` is stateless; what it caches for one graph on one cluster lives in the
Evaluator (`Evaluator.state`). The hooks see the Evaluator as `Pricing`, the protocol below of
what they read of it, so this package never imports planner/evaluator.py (which imports the
registry). Every hook has a neutral default, so a strategy overrides only what it changes. The
registry (planner/strategies/registry.py) lists the strategies in composition order: a strategy
listed later refines the ones before it (its layer cost adjustment runs after theirs, its stage
bounds win over theirs, and the last active `Placement` prices the step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, TypeVar, runtime_checkable

from runtime.vocab import StrategyName

if TYPE_CHECKING:
    from cost_models.gpu_costs import GpuCosts
    from cost_models.hardware import Cluster
    from cost_models.overlap import DeviceWork, Overlap
    from cost_models.prediction import MemoryBreakdown, Prediction, TimeBreakdown
    from cost_models.step_costs import StepSetup
    from planner.config import ParallelConfig
    from planner.graph.model import Layer, ModelGraph, OpInfo
    from planner.layer_cost import LayerCost
    from runtime.execution import Execution

T = TypeVar("T")

Bounds = list[tuple[int, int]]            # [lo, hi) layer ranges of the pipeline stages
Fits = Callable[[int, int, int], bool]    # fits(stage, lo, hi): layers [lo, hi) fit on that stage's device


class NodeSplit(Protocol):
    """How one node splits over the ranks of the strategy that splits nodes (Strategy.splits_nodes)."""

    sharded: bool   # the node has a split role of its own (its weights or features divide)

    def divisor(self, ranks: int) -> float:
        """What its split dimension is divided by on one of `ranks` ranks (fewer than `ranks` where a size they
        do not divide is padded)."""


class GraphSplits(Protocol):
    """The splitting strategy's description of one graph (Strategy.graph_splits): each node's split, by fx name."""

    roles: Mapping[str, NodeSplit]

    def check(self, ranks: int) -> None:
        """Raise ValueError naming the first split size `ranks` does not divide and may not pad."""


class SplitAnalysis(Protocol):
    """Whether, and how, a graph's split roles can be carried out under a configuration (the splitting
    strategy's split_analysis, remembered per roles and configuration: the search asks it many times)."""

    def refusal(self, roles: dict[str, str], config: "ParallelConfig") -> str | None:
        """Why nodes with split `roles` (fx name -> role) cannot be split under `config`, or None."""

    def get(self, roles: dict[str, str], config: "ParallelConfig") -> Any:
        """The split the Plan stores (None where nothing is split); raises the refusal's error."""

    def for_plan(self, roles: dict[str, str], config: "ParallelConfig") -> Any:
        """As get, for a plan about to be returned: ConfigError naming the node on failure."""


@runtime_checkable
class Pricing(Protocol):
    """What the strategies' hooks read of the Evaluator (planner/evaluator.py, which satisfies this):
    the graph and cluster it prices, how the stack runs (overlap, execution, the step besides the
    model), per-graph caches (`state`), and its pricing of nodes, collectives and whole steps."""

    graph: "ModelGraph"
    cluster: "Cluster"
    overlap: "Overlap"
    execution: "Execution"
    setup: "StepSetup"
    sharding: GraphSplits           # how each node splits (the splitting strategy's graph_splits)
    sharding_mode: str              # "ilp" or "all"
    gpu_costs: "GpuCosts | None"    # None off a GPU
    eff: Any                        # per-kind efficiencies (cost_models/compute.Efficiency)
    grad_reduce_bytes: float | None  # bytes per gradient element in the data-parallel sync (None: dtype's)
    allocator_margin: float         # fraction the caching allocator reserves beyond what is allocated
    memory_cap: float               # bytes per device a stage may hold
    strategies: tuple["Strategy", ...]
    tp_wrapper: Any                 # calibrated cost around a tensor-parallel layer's all-reduce (per element)
    tp_embedding: Any               # ... around a vocabulary-parallel embedding's

    def state(self, key: str, make: Callable[[], T]) -> T:
        """The value cached under `key` for this graph and cluster, made by `make()` the first time."""

    def node(self, name: str) -> "OpInfo":
        """The graph's node called `name`."""

    def node_cost(self, n: "OpInfo", role: str, config: "ParallelConfig", *, fused_head: bool = False,
                  compiled: bool = False) -> Any:
        """Seconds and bytes of node `n` under split role `role`."""

    def axis_seconds(self, mesh: dict[str, int], axis: str, op: str, nbytes: float) -> float:
        """Seconds of collective `op` over `nbytes` on mesh axis `axis`."""

    def gpu(self, dtype: str) -> Any:
        """The GPU cost model for `dtype` (None off a GPU)."""

    def layer_roles(self, layer: "Layer", config: "ParallelConfig") -> dict[str, str]:
        """Split roles of `layer`'s nodes under `config`, from every active strategy."""

    def grad_sync(self, config: "ParallelConfig", params: float, work: "DeviceWork", m: int) -> tuple[float, float]:
        """(exposed, on-path) seconds of every active strategy's gradient traffic per step."""

    def split_divisor(self, name: str, role: str | None, config: "ParallelConfig") -> float:
        """What node `name`'s split dimension (its features, heads, vocabulary) is divided by on one rank under
        split role `role` (a ShardRole; None or replicated: 1)."""

    def grad_replicas(self, config: "ParallelConfig") -> int:
        """Ranks that hold the same weights and sum their gradients at run time (Strategy.replicates_weights)."""

    def tie_costs(self, config: "ParallelConfig", bounds: list[tuple[int, int]]) -> tuple[dict[int, float], float]:
        """Per pipeline position, the tied-weight sync seconds, and their longest."""

    def prediction(self, config: "ParallelConfig", global_batch_size: int, m: int, costs: list["LayerCost"],
                   stages: list, time: "TimeBreakdown", peak_mem: "MemoryBreakdown", busy: float) -> "Prediction":
        """The step's Prediction from its time and memory breakdowns."""


@dataclass(frozen=True)
class MeshShape:
    """One plain mesh shape the search considers, with what its configs share.

    degrees: the shape's degrees by ParallelConfig field (the search enumerates data x tensor x pipeline;
    a strategy reads the two every plan has, `data` and `pipeline`, and copies the rest with `fields`);
    micro_batch_sizes: the micro-batch sizes (samples) the constraints allow for this shape;
    max_micro_batch_size: their cap; num_layers: layers the pipeline can cut between;
    global_batch_size: samples per optimizer step.
    """

    degrees: tuple[tuple[str, int], ...]
    micro_batch_sizes: tuple[int, ...]
    max_micro_batch_size: int
    dtype: str
    num_layers: int
    global_batch_size: int

    @property
    def data(self) -> int:
        return dict(self.degrees)[StrategyName.DATA]

    @property
    def pipeline(self) -> int:
        return dict(self.degrees)[StrategyName.PIPELINE]

    def fields(self, **changes: Any) -> dict[str, Any]:
        """Keyword arguments of a ParallelConfig of this shape (its degrees and dtype), with `changes`."""
        return {**dict(self.degrees), "dtype": self.dtype, **changes}


class Strategy:
    """One parallel dimension, planner side (see module docstring)."""

    name: StrategyName
    named_at_one = False   # device-count messages name this degree even where it is 1
    # whether meshplan's runtime may compile its layers and fuse the chunked loss where it is active (not
    # where the stage code exchanges tiles, paths or sequence chunks inside the layers:
    # planner/execution_choice.py prices the defaults alone there)
    compiles = True
    # whether its ranks hold the same weights and run as data-parallel replicas at run time (codegen
    # lowers the plan to a data-parallel twin over data x this degree), so meshplan's runtime sums their
    # gradients in buckets (runtime/execute/grads.py): data, and spatial tiles and context chunks
    replicates_weights = False

    def active(self, config: "ParallelConfig") -> bool:
        """Whether `config` uses this strategy: by default, whether its degree (the ParallelConfig field
        of the strategy's name) is above 1."""
        return getattr(config, self.name) > 1

    def mesh_factor(self, config: "ParallelConfig") -> tuple[str, int] | None:
        """(name, degree) of this strategy's factor of the device count, where it is worth naming."""
        degree = getattr(config, self.name)
        return (self.name, degree) if degree > 1 or self.named_at_one else None

    # ---- the node split: one registered strategy divides nodes over its ranks (split roles) ----
    # whether this is that strategy: its node_roles give nodes split roles, graph_splits describes a graph's
    # splits, split_ranks counts the ranks a split node spreads over, on its comm_axis
    splits_nodes = False

    def graph_splits(self, graph: "ModelGraph") -> GraphSplits:
        """How each node of `graph` may split (the strategy with splits_nodes only)."""
        raise NotImplementedError(f"the {self.name} strategy does not split nodes")

    def split_analysis(self, graph: "ModelGraph") -> SplitAnalysis:
        """A fresh analysis of whether `graph`'s split roles can be carried out (splits_nodes' strategy only)."""
        raise NotImplementedError(f"the {self.name} strategy does not split nodes")

    def target_splits(self, graph: "ModelGraph", splits: GraphSplits, degrees, kinds) -> GraphSplits:
        """`splits` without the regions a target's code generator cannot split at any of `degrees`, where the
        target splits the weights of op kinds `kinds` only (None: every kind); splits_nodes' strategy only."""
        raise NotImplementedError(f"the {self.name} strategy does not split nodes")

    def split_ranks(self, config: "ParallelConfig") -> int:
        """The ranks a node with a split role is spread over under `config` (1: nothing is split)."""
        return 1

    def sequence_ranks(self, config: "ParallelConfig") -> int:
        """What the activations between split regions (whole on each rank) are divided by under `config`:
        the split ranks where they also split the sequence, else 1."""
        return 1

    # ---- search -------------------------------------------------------------
    def pinned_on(self, constraints: dict) -> bool:
        """Whether the search constraints require this strategy (every candidate must use it)."""
        return False

    def shape_configs(self, shape: MeshShape, constraints: dict) -> list["ParallelConfig"]:
        """Configs of one mesh shape that this strategy adds to the search (schedules, replicas)."""
        return []

    def variants(self, ev: "Pricing", num_devices: int, constraints: dict,
                 shapes_of: Callable[[int], list["ParallelConfig"]]) -> list["ParallelConfig"]:
        """Configs that give this strategy part of the `num_devices` devices; `shapes_of(n)` lists the
        plain data x tensor x pipeline configs of the n devices left."""
        return []

    # ---- the plan -------------------------------------------------------------
    def plan_part(self, graph: "ModelGraph", config: "ParallelConfig") -> Any:
        """This strategy's own part of the Plan for `config` (a planner.strategies.field_hooks.PlanPart; its
        fields module declares the kind, so that a plan file reads it back), or None. Raises ConfigError
        naming what `graph` lacks for `config`."""
        return None

    # ---- pricing ------------------------------------------------------------
    def check(self, ev: "Pricing", config: "ParallelConfig") -> None:
        """Raise ValueError naming what to change when `config` cannot run `ev`'s graph."""

    def node_roles(self, ev: "Pricing", layer: "Layer", config: "ParallelConfig") -> dict[str, str]:
        """Split roles this strategy gives `layer`'s nodes (fx node name -> role; the rest replicated)."""
        return {}

    # ---- node pricing: the Evaluator's node_cost asks every active strategy ------------
    def cache_key(self, config: "ParallelConfig") -> tuple:
        """The config values this strategy's node hooks read beyond the mesh degrees, micro-batch, dtype and
        recompute (part of the Evaluator's per-layer cache keys)."""
        return ()

    def token_share(self, ev: "Pricing", name: str, role: str, config: "ParallelConfig") -> float:
        """What node `name`'s tokens (its FLOPs and activation bytes) are divided by on one device under
        this strategy, given its split `role` (a ShardRole)."""
        return 1

    def boundary_share(self, ev: "Pricing", layer: "Layer", config: "ParallelConfig") -> float:
        """What the bytes crossing the pipeline cut after `layer` are divided by under this strategy."""
        return 1

    # the mesh axis (a MeshAxis value) node_comm's collectives run on: the LayerCost keeps them under it
    comm_axis: str | None = None

    def node_comm(self, ev: "Pricing", n: "OpInfo", role: str, config: "ParallelConfig", scale: float,
                  ds: float) -> tuple[float, float]:
        """(forward s, backward s) of the collectives inside node `n` this strategy adds for one micro-batch
        on its `comm_axis` (`scale`: the micro-batch's fraction of the captured batch; `ds`: the dtype's
        size over the captured one)."""
        return 0.0, 0.0

    # True where layer_cost depends on the layer only through its signature (and `cost`, `config`): the
    # Evaluator then adjusts each distinct layer of a model's repeated blocks once per configuration
    layer_cost_by_signature: bool = False

    def layer_cost(self, ev: "Pricing", layer: "Layer", cost: "LayerCost",
                   config: "ParallelConfig") -> "LayerCost":
        """`cost` (one layer, one device, one micro-batch) adjusted for this strategy."""
        return cost

    def stage_bounds(self, ev: "Pricing", config: "ParallelConfig", costs: list["LayerCost"],
                     weights: list[float], fits: Fits | None) -> Bounds | None:
        """Stage bounds this strategy imposes (weights: seconds per layer), or None to leave them."""
        return None

    def grad_sync(self, ev: "Pricing", config: "ParallelConfig", params: float, work: "DeviceWork",
                  m: int) -> tuple[float, float]:
        """(exposed seconds, on-path seconds) per step of this strategy's gradient and weight traffic for
        the device holding `params` parameters, whose compute per micro-batch (`work`, per layer and
        chunk) can hide it as the Evaluator's `overlap` allows."""
        return 0.0, 0.0


class Placement(Strategy, ABC):
    """A strategy that lays the pipeline stages on devices and prices the whole step (pipeline and
    its bi-directional refinement); the Evaluator asks the last active one."""

    @abstractmethod
    def stage_fits(self, ev: "Pricing", config: "ParallelConfig", costs: list["LayerCost"],
                   global_batch_size: int) -> Fits | None:
        """The memory check the stage partition respects, or None where the bounds check memory themselves."""

    @abstractmethod
    def step(self, ev: "Pricing", config: "ParallelConfig", global_batch_size: int, m: int,
             costs: list["LayerCost"], bounds: Bounds) -> "Prediction":
        """The step's Prediction: time breakdown, peak memory, per-stage costs."""

    @abstractmethod
    def lower_bound(self, ev: "Pricing", config: "ParallelConfig", costs: list["LayerCost"], m: int,
                    slot: float) -> float:
        """Seconds per step that every recompute/ZeRO variant of `config` takes at least, given the
        average device's compute and in-layer communication per micro-batch (`slot` s)."""
