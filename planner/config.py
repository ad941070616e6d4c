"""`ParallelConfig`: one point of the search space, as a small validated value.

Degrees multiply to the device count. New parallel dimensions (spatial,
sub-graph, bi-directional pipelines) are added as fields with neutral
defaults, so every existing config stays valid and `num_devices` stays the
product of all degrees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from planner.config_fields import ConfigFields
from planner.strategies.combinations import Level
from planner.strategies.combinations import why_not as combination_refusal
from planner.strategies.fields import field_refusal, micro_batch_refusal
from planner.strategies.fields import label as strategy_label
from planner.strategies.fields import unused_fields
from runtime.documents import FieldError, refuse_unknown_fields
from runtime.vocab import ContextAttention, DType, RecomputeMode, Schedule, SpatialBatchNorm, SpatialSplit

# the fields whose value is one of a vocabulary's members (given as the member or its string; held as the string)
_CHOICES: tuple[tuple[str, type[StrEnum]], ...] = (
    ("schedule", Schedule), ("recompute", RecomputeMode), ("dtype", DType),
    ("spatial_split", SpatialSplit), ("spatial_batchnorm", SpatialBatchNorm),
    ("context_attention", ContextAttention),
)


class ConfigError(ValueError):
    """A ParallelConfig that cannot describe a valid run."""


@dataclass(frozen=True)
class ParallelConfig(ConfigFields):
    """How one training step is split over devices.

    Attributes:
        data, tensor, pipeline: degrees of the mesh axes (devices = product).
        micro_batch_size: samples per micro-batch on one data-parallel rank.
        schedule: pipeline schedule, a runtime.vocab.Schedule value.
        virtual_stages: model chunks per device (interleaved schedule only).
        recompute: activation recomputation, a runtime.vocab.RecomputeMode value.
        zero: ZeRO stage 0-3 (sharding of optimizer state, gradients, parameters over data).
        dtype: compute dtype; "bf16"/"fp16" mean mixed precision with fp32 master weights and Adam state.
        stage_boundaries: optional names of the first layer of every stage after the first
            (pipeline * virtual_stages - 1 names); None lets the planner balance stages.
        bidirectional: GEMS bi-directional pipeline: a second replica runs the stages in
            reverse over the same devices (device r holds stage r and stage p-1-r).
        replicas_per_direction: MASTER's T; each step runs 2T micro-batches (T per direction).
        spatial: spatial degree s: the layers up to and including `spatial_until` (a layer
            name) run on s tiles of each image, split as `spatial_split` (strips_h: s
            horizontal strips, strips_v: s vertical strips, grid: rows x cols); the tiles
            are gathered after that layer and the later layers run replicated on the s
            devices. `spatial_batchnorm`: "sync" (statistics over the whole image, exact)
            or "local" (per-tile statistics, cheaper, not equal to the unsplit model).
        subgraph: sub-graph parallelism (SUPER) degree B: each data replica's devices form B
            sub-grids (the "subgraph" mesh axis) on the same samples; the independent paths of the
            model's fork/join branches are dealt to them (planner/strategies/subgraph/regions.py), the rest
            runs replicated.
        sequence_parallel: Megatron-style sequence parallelism inside the tensor axis (tensor >= 2):
            the norms, dropout and residual adds between tensor-parallel regions run on 1/t of
            the sequence; each region starts with an all-gather and ends with a reduce-scatter
            along the sequence in place of the all-reduce.
        context: context-parallel degree c (the "context" mesh axis): every layer's activations
            are split along the sequence over c ranks; attention reaches the other ranks' keys
            and values as `context_attention` says ("ring" or "ulysses", runtime.vocab.ContextAttention).
    """

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "pipeline", "micro_batch_size", "virtual_stages", "replicas_per_direction",
                     "spatial", "subgraph", "context"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"ParallelConfig.{name} must be a positive integer, got {v!r}")
        for name, vocabulary in _CHOICES:
            v = getattr(self, name)
            try:
                member = vocabulary(v)
            except ValueError:
                raise ConfigError(f"ParallelConfig.{name}={v!r} is not one of {', '.join(vocabulary)}") from None
            object.__setattr__(self, name, member.value)   # plain strings: reprs in generated code stay literals
        # each strategy's own fields (planner/strategies/fields.py), then how they combine (combinations.py)
        refusal = field_refusal(self) or combination_refusal(self, Level.CONFIG)
        if refusal:
            raise ConfigError(refusal)
        if self.stage_boundaries is not None:
            object.__setattr__(self, "stage_boundaries", tuple(self.stage_boundaries))
            want = self.num_stages - 1
            if len(self.stage_boundaries) != want:
                raise ConfigError(f"stage_boundaries names {len(self.stage_boundaries)} layers; "
                                  f"{self.num_stages} stages need {want} (the first layer of each stage after the first)")

    def micro_batches(self, global_batch_size: int) -> int:
        """Micro-batches per step on each pipeline; ValueError when the batch does not split evenly."""
        per_replica = self.micro_batch_size * self.data
        if global_batch_size < 1 or global_batch_size % per_replica:
            raise ConfigError(
                f"global batch {global_batch_size} is not a multiple of micro_batch_size "
                f"{self.micro_batch_size} x data {self.data} = {per_replica}; pick a micro-batch size "
                f"or data degree that divides it"
            )
        m = global_batch_size // per_replica
        refusal = micro_batch_refusal(self, global_batch_size, m)   # planner/strategies/fields.py
        if refusal:
            raise ConfigError(refusal)
        return m

    def short(self) -> str:
        """A compact label, e.g. "d4 t8 p12 mb1 1f1b rc=full z0 bf16"."""
        return (f"d{self.data} t{self.tensor} p{self.pipeline} mb{self.micro_batch_size} {strategy_label(self)} "
                f"rc={self.recompute} z{self.zero} {self.dtype}")

    def replace(self, **changes: Any) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["stage_boundaries"] is not None:
            d["stage_boundaries"] = list(d["stage_boundaries"])
        for name in unused_fields(self):
            del d[name]
        return d

    @classmethod
    def read(cls, f) -> "ParallelConfig":
        """From a checked document reader (runtime.documents.Fields): types checked field by field."""
        known = {fl.name for fl in dataclasses.fields(cls)}
        for key in f.data:
            if key not in known:
                raise f.error(key, f"is not a ParallelConfig field; known: {', '.join(sorted(known))}")
        kw: dict[str, Any] = {}
        for name in ("data", "tensor", "pipeline", "micro_batch_size", "virtual_stages", "zero",
                     "replicas_per_direction", "spatial", "subgraph", "context"):
            if name in f.data:
                kw[name] = f.integer(name)
        for name in ("schedule", "recompute", "dtype", "spatial_split", "spatial_batchnorm", "context_attention"):
            if name in f.data:
                kw[name] = f.text(name)
        if f.data.get("spatial_until") is not None:
            kw["spatial_until"] = f.text("spatial_until")
        for name in ("bidirectional", "sequence_parallel"):
            if name in f.data:
                kw[name] = f.boolean(name)
        if f.data.get("stage_boundaries") is not None:
            kw["stage_boundaries"] = tuple(f.strings("stage_boundaries"))
        try:
            return cls(**kw)
        except ConfigError as e:
            raise FieldError(f.where, f.prefix or "config", f"is invalid: {e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        refuse_unknown_fields(d, cls, "ParallelConfig", ConfigError)
        d = dict(d)
        if d.get("stage_boundaries") is not None:
            d["stage_boundaries"] = tuple(d["stage_boundaries"])
        return cls(**d)

