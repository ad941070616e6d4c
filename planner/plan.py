"""`Plan`: the planner's answer, a frozen value that round-trips through JSON.

A plan is bound to the graph it was made for (`graph_fingerprint`) and names
everything by layer name or fx node name, never by position alone: stages
are lists of layer names, tensor-parallel roles are keyed by node name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cost_models.cluster_file import ClusterFileError
from cost_models.hardware import Cluster
from cost_models.prediction import MemoryBreakdown, Prediction, StagePrediction, TimeBreakdown
from planner.config import ConfigError, ParallelConfig
from planner.strategies import describe
from planner.strategies.field_hooks import SplitsView
from planner.strategies.fields import node_split_fields
from runtime.documents import FieldError, Fields, read_document
from runtime.execution import Execution
from runtime.program.parts import find_part
from runtime.vocab import ShardRole, Target

PLAN_FORMAT_VERSION = 2   # 2: the tensor-parallel split is stored ("tensor_splits"); 1 still loads
# The largest global batch (samples per step) and world (devices) a plan may have: far past
# any real run, and small enough that searching, checking and lowering one stays bounded.
MAX_BATCH = 2 ** 31
MAX_WORLD = 65536


class PlanFileError(ValueError):
    """A plan file that cannot be read; the message names the field and the file."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (a chunk, under the interleaved schedule).

    `device_index` is the position on the pipeline axis that runs it: stage
    k runs on pipeline position k % pipeline.
    """

    index: int
    device_index: int
    layers: tuple[str, ...]   # layer names, in model order


@dataclass(frozen=True)
class Alternative:
    """A configuration the search priced and did not choose, and why it lost."""

    config: ParallelConfig
    step_time: float          # s
    peak_memory: float        # bytes per device
    step_energy: float        # J per step
    fits: bool
    reason: str

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "step_time": self.step_time, "peak_memory": self.peak_memory,
                "step_energy": self.step_energy, "fits": self.fits, "reason": self.reason}

    @classmethod
    def read(cls, f: Fields) -> "Alternative":
        return cls(config=ParallelConfig.read(f.sub("config")), step_time=f.number("step_time", minimum=0),
                   peak_memory=f.number("peak_memory", minimum=0), step_energy=f.number("step_energy", minimum=0),
                   fits=f.boolean("fits"), reason=f.text("reason"))


@dataclass(frozen=True)
class Plan:
    format_version: int
    model_class: str
    graph_fingerprint: str
    cluster: Cluster
    config: ParallelConfig
    global_batch_size: int
    stages: tuple[Stage, ...]
    shardings: tuple[tuple[str, str], ...]  # (fx node name, tensor-parallel role) for non-replicated nodes
    prediction: Prediction
    search: tuple[tuple[str, Any], ...] = ()  # how the plan was found: candidates evaluated, pruned, seconds
    alternatives: tuple[Alternative, ...] = ()  # the next best configurations, best first
    # the strategies' own parts (planner/strategies/field_hooks.PlanPart; sub-graph parallelism's split regions
    # and which sub-grid runs each path), each under its key in the plan document
    parts: tuple[Any, ...] = ()
    # the split of every value over the tensor ranks, decided by the planner (planner/strategies/tensor/split/);
    # None where nothing is split, or in a plan read from a version-1 file (codegen then decides it)
    tensor_splits: SplitsView | None = None
    # what the plan was made for (a runtime.vocab.Target value; planner/capabilities.py says what each runs);
    # written only when not meshplan's own runtime, so plans of earlier builds read unchanged
    target: str = Target.MESHPLAN
    # the captured model's parameter count (elements), to say how another model differs
    # (planner/binding.py); 0 in plans written before it was recorded
    graph_params: int = 0
    # how the stages' compute runs (compiled stages, the fused chunked loss, the padded vocabulary;
    # runtime/execution.py); written only when not the defaults, so earlier plans read unchanged
    execution: Execution = field(default_factory=Execution)

    # ---- views ----------------------------------------------------------
    @property
    def mesh(self) -> dict[str, int]:
        return self.config.mesh

    def part(self, key: str) -> Any:
        """The strategy part stored under `key` (a PlanPart's key), or None."""
        return find_part(self.parts, key)

    @property
    def subgraph(self) -> tuple:
        """The split regions of sub-graph parallelism's part (() without one), as plans had them as a field."""
        part = self.part("subgraph")
        return part.regions if part is not None else ()

    def role(self, node: str) -> str:
        return dict(self.shardings).get(node, ShardRole.REPLICATE)

    @property
    def split_ranks(self) -> int:
        """The ranks a split node (a role other than replicated, `shardings`) is spread over: the degree of the
        strategy that splits nodes (StrategyFields.split_degree)."""
        return getattr(self.config, node_split_fields().split_degree)

    def summary(self) -> str:
        """A readable table: mesh, stages, memory per stage, time breakdown."""
        c, p = self.config, self.prediction
        gib = 2**30
        lines = [
            f"Plan for {self.model_class} on {self.cluster.name} "
            f"({self.cluster.num_nodes} x {self.cluster.devices_per_node} = {self.cluster.num_devices} devices)"
            + (f" for the {self.target} target" if self.target != Target.MESHPLAN else ""),
            "  mesh: " + " x ".join(f"{k} {v}" for k, v in self.mesh.items()) +
            f"   micro-batch {c.micro_batch_size} x {p.num_micro_batches}   schedule {describe.schedule_text(c)}"
            + f"   recompute {c.recompute}   ZeRO {c.zero}   {c.dtype}",
            *describe.config_lines(c),
            *([f"  execution: {' '.join(self.execution.options())}"] if not self.execution.is_default else []),
            f"  global batch {self.global_batch_size}: step {p.step_time:.4g} s, {p.samples_per_s:,.2f} samples/s"
            + (f", {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else "") + f", MFU {p.mfu:.1%}",
            "",
            f"  {'stage':>5} {'dev':>4} {'layers':>7}  {'first .. last':<38} {'fwd ms':>9} {'bwd ms':>9} {'mem GiB':>8}",
        ]
        for s, sp in zip(self.stages, p.stages):
            span = f"{s.layers[0]} .. {s.layers[-1]}" if len(s.layers) > 1 else s.layers[0]
            dev = describe.stage_device(c, s)
            lines.append(f"  {s.index:>5} {dev:>4} {len(s.layers):>7}  {span[:38]:<38} "
                         f"{sp.forward * 1e3:>9.3f} {sp.backward * 1e3:>9.3f} {sp.memory.total / gib:>8.3f}")
        lines += describe.sections(self)
        lines += ["", "  time per step:"]
        total = p.step_time or 1.0
        for f in dataclasses.fields(p.time):
            v = getattr(p.time, f.name)
            if v > 0:
                lines.append(f"    {f.name:<14} {v * 1e3:>12.3f} ms  {v / total:>6.1%}")
        m = p.memory
        lines += ["", f"  memory per device (peak {p.peak_memory / gib:.2f} of {p.memory_capacity / gib:.0f} GiB):"]
        for f in dataclasses.fields(m):
            v = getattr(m, f.name)
            if v > 0:
                lines.append(f"    {f.name:<14} {v / gib:>12.3f} GiB")
        if self.search:
            lines += ["", "  search: " + ", ".join(f"{k} {v}" for k, v in self.search)]
        return "\n".join(lines)

    # ---- JSON -----------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "model_class": self.model_class,
            "graph_fingerprint": self.graph_fingerprint,
            "cluster": self.cluster.to_dict(),
            "config": self.config.to_dict(),
            "global_batch_size": self.global_batch_size,
            "stages": [{"index": s.index, "device_index": s.device_index, "layers": list(s.layers)}
                       for s in self.stages],
            "shardings": {k: v for k, v in self.shardings},
            "prediction": self.prediction.to_dict(),
            "search": {k: v for k, v in self.search},
            "alternatives": [a.to_dict() for a in self.alternatives],
            **{p.key: p.to_json() for p in self.parts},
            **({"tensor_splits": self.tensor_splits.to_dict()} if self.tensor_splits is not None else {}),
            **({"target": self.target} if self.target != Target.MESHPLAN else {}),
            **({"graph_params": self.graph_params} if self.graph_params else {}),
            **({"execution": self.execution.to_dict()} if not self.execution.is_default else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, *, origin: str | None = None) -> "Plan":
        """Read and check a plan document; PlanFileError names the field on any damage."""
        where = f"plan file {origin}" if origin else "plan"
        try:
            return _read_plan(Fields(d, where), origin)
        except FieldError as e:
            raise PlanFileError(str(e)) from None
        except ClusterFileError as e:
            raise PlanFileError(f"{where}: in 'cluster': {e}") from None
        except ConfigError as e:
            raise PlanFileError(f"{where}: in 'config': {e}") from None

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (creating missing directories); PlanFileError if it cannot."""
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(self.to_dict(), indent=1))
        except OSError as e:
            raise PlanFileError(f"cannot write plan file {p}: {e.strerror or e}") from None

    def check_layers(self, layer_names: list[str]) -> None:
        """PlanFileError unless the stages, in order, hold exactly `layer_names` (the graph's
        layers in model order), each once: what make_plan produces and codegen needs."""
        held = [name for st in self.stages for name in st.layers]
        if held == list(layer_names):
            return
        k = next((i for i, (a, b) in enumerate(zip(held, layer_names)) if a != b), min(len(held), len(layer_names)))
        where = next(i for i, st in enumerate(self.stages) if sum(len(s.layers) for s in self.stages[:i + 1]) > k) \
            if k < len(held) else len(self.stages) - 1
        want = layer_names[k] if k < len(layer_names) else "no more layers"
        got = held[k] if k < len(held) else "nothing"
        raise PlanFileError(f"plan: stages[{where}] holds {got} where the model has {want} (layer {k}); the stages "
                            f"must hold the model's {len(layer_names)} layers in order, each once. Make the plan again")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(read_document(path, "plan file", error=PlanFileError), origin=str(path))


ROLES = (ShardRole.COLUMN, ShardRole.ROW, ShardRole.INNER, ShardRole.VOCAB, ShardRole.COLUMN_OUT)


def upgrade_v1(d: dict) -> dict:
    """A version-1 plan document as version 2: the same plan with no stored tensor-parallel split
    (version 1 kept only the roles; the code generator decides the split from them)."""
    return {**d, "format_version": PLAN_FORMAT_VERSION}


def _read_plan(f: Fields, origin: str | None) -> Plan:
    if f.raw("format_version") == 1:
        f = Fields(upgrade_v1(f.data), f.where, f.prefix)
    version = f.raw("format_version")
    if version != PLAN_FORMAT_VERSION:
        raise f.error("format_version", f"is {version!r}; this meshplan reads version {PLAN_FORMAT_VERSION}. "
                      "Make the plan again with this version")
    cluster_doc = f.raw("cluster")
    if not isinstance(cluster_doc, dict):
        raise f.error("cluster", "must be a JSON object (a cluster description)")
    cluster = Cluster.from_dict(cluster_doc, origin=origin)
    config = ParallelConfig.read(f.sub("config"))
    if config.num_devices != cluster.num_devices:
        raise f.error("config", f"uses {config.num_devices} devices but the plan's cluster has {cluster.num_devices}")
    if config.num_devices > MAX_WORLD:
        raise f.error("config", f"uses {config.num_devices} devices; meshplan plans at most {MAX_WORLD}")
    batch = f.integer("global_batch_size", minimum=1)
    if batch > MAX_BATCH:
        raise f.error("global_batch_size", f"is {batch}; meshplan plans batches of at most {MAX_BATCH} samples")
    try:
        config.micro_batches(batch)
    except ConfigError as e:
        raise f.error("global_batch_size", f"does not fit the config: {e}") from None
    stages = tuple(f.each("stages", lambda s: Stage(s.integer("index", minimum=0), s.integer("device_index", minimum=0),
                                                     tuple(s.strings("layers")))))
    if len(stages) != config.num_stages:
        raise f.error("stages", f"lists {len(stages)} stages; the config has {config.num_stages}")
    seen: set[str] = set()
    for k, st in enumerate(stages):
        if st.index != k:
            raise f.error(f"stages[{k}].index", f"is {st.index}, expected {k} (stages in order)")
        if not st.layers:
            raise f.error(f"stages[{k}].layers", "is empty; every stage holds at least one layer")
        dup = seen & set(st.layers)
        if dup:
            raise f.error(f"stages[{k}].layers", f"repeats layer(s) {sorted(dup)[:3]} of an earlier stage")
        seen |= set(st.layers)
    roles = f.sub("shardings", {})
    for node, role in roles.data.items():
        if role not in ROLES:
            raise roles.error(node, f"has role {role!r}; known roles: {', '.join(ROLES)}")
    prediction = _read_prediction(f.sub("prediction"))
    if len(prediction.stages) != len(stages):
        raise f.error("prediction.stages", f"has {len(prediction.stages)} entries for {len(stages)} stages")
    for k, (st, sp) in enumerate(zip(stages, prediction.stages)):
        # The prediction was made for these stages: an edit of one without the other (layers moved,
        # reordered or dropped) leaves a plan that describes one model split and prices another.
        if (st.layers[0], st.layers[-1], len(st.layers)) != (sp.first_layer, sp.last_layer, sp.num_layers):
            raise f.error(f"stages[{k}].layers", f"runs {st.layers[0]}..{st.layers[-1]} ({len(st.layers)} layers) "
                          f"but the prediction priced {sp.first_layer}..{sp.last_layer} ({sp.num_layers}); "
                          "make the plan again (meshplan optimize, or codegen with the configuration)")
    search = f.sub("search", {})
    target = f.text("target", Target.MESHPLAN.value)
    if target not in set(Target):
        raise f.error("target", f"is {target!r}; known targets: {', '.join(Target)}")
    plan = Plan(
        format_version=version, model_class=f.text("model_class"), graph_fingerprint=f.text("graph_fingerprint"),
        cluster=cluster, config=config, global_batch_size=batch,
        stages=stages, shardings=tuple(sorted(roles.data.items())), prediction=prediction,
        search=tuple(search.data.items()),
        alternatives=tuple(f.each("alternatives", Alternative.read, [])),
        parts=tuple(part for kind in describe.plan_parts() if (part := kind.read(f)) is not None),
        tensor_splits=node_split_fields().node_splits.read(f.sub("tensor_splits")) if "tensor_splits" in f.data
        else None,
        target=Target(target).value,
        graph_params=f.integer("graph_params", 0, minimum=0),
        execution=Execution.read(f.sub("execution")) if "execution" in f.data else Execution(),
    )
    problem = next(describe.plan_problems(plan), None)
    if problem is not None:
        raise f.error(*problem)
    return plan


# entries plans written before they were priced lack: 0 (the fragmentation margin; on a GPU, autocast's weight
# copies, the loss's buffers and its time, the host's dispatch)
_LATER_MEMORY = ("fragmentation", "weight_copies", "loss")
_LATER_TIME = ("loss", "host")


def _read_memory(f: Fields) -> MemoryBreakdown:
    return MemoryBreakdown(**{k: f.number(k, **({"default": 0.0} if k in _LATER_MEMORY else {}), minimum=0)
                              for k in MemoryBreakdown.__dataclass_fields__})


def _read_prediction(f: Fields) -> Prediction:
    time = f.sub("time")
    return Prediction(
        step_time=f.number("step_time", minimum=0),
        time=TimeBreakdown(**{k: time.number(k, **({"default": 0.0} if k in _LATER_TIME else {}))
                              for k in TimeBreakdown.__dataclass_fields__}),
        peak_memory=f.number("peak_memory", minimum=0), memory=_read_memory(f.sub("memory")),
        memory_capacity=f.number("memory_capacity", minimum=0), fits=f.boolean("fits"),
        samples_per_s=f.number("samples_per_s", minimum=0), tokens_per_s=f.optional_number("tokens_per_s"),
        model_flops_per_device=f.number("model_flops_per_device", minimum=0), mfu=f.number("mfu", minimum=0),
        num_micro_batches=f.integer("num_micro_batches", minimum=1),
        stages=tuple(f.each("stages", lambda s: StagePrediction(
            index=s.integer("index", minimum=0), first_layer=s.text("first_layer"), last_layer=s.text("last_layer"),
            num_layers=s.integer("num_layers", minimum=1), forward=s.number("forward", minimum=0),
            backward=s.number("backward", minimum=0), memory=_read_memory(s.sub("memory")),
            host_forward=s.number("host_forward", 0.0, minimum=0), host_backward=s.number("host_backward", 0.0, minimum=0)))),
        step_energy=f.number("step_energy", 0.0, minimum=0),
    )
