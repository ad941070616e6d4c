"""`ConfigFields`: the fields of a ParallelConfig (planner/config.py) and what follows from them alone
(the device count, the stages, the mesh), with no checks.

ParallelConfig adds the checks, and runs the per-strategy ones of planner/strategies/fields.py and
combinations.py; those read a config as ConfigFields, so they never import planner/config.py, which
imports them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from runtime.vocab import ContextAttention, DType, MeshAxis, RecomputeMode, Schedule, SpatialBatchNorm, SpatialSplit


@dataclass(frozen=True)
class ConfigFields:
    """The fields of a ParallelConfig (see its docstring for each), unchecked."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    micro_batch_size: int = 1
    schedule: str = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    recompute: str = RecomputeMode.NONE
    zero: int = 0
    dtype: str = DType.BF16
    stage_boundaries: tuple[str, ...] | None = None
    bidirectional: bool = False
    replicas_per_direction: int = 1
    spatial: int = 1
    spatial_split: str = SpatialSplit.STRIPS_H
    spatial_until: str | None = None
    spatial_batchnorm: str = SpatialBatchNorm.SYNC
    subgraph: int = 1
    sequence_parallel: bool = False
    context: int = 1
    context_attention: str = ContextAttention.RING

    @property
    def num_devices(self) -> int:
        return self.data * self.tensor * self.pipeline * self.spatial * self.subgraph * self.context

    @property
    def num_stages(self) -> int:
        """Model chunks in the pipeline (pipeline x virtual_stages)."""
        return self.pipeline * self.virtual_stages

    @property
    def mesh(self) -> dict[str, int]:
        """Mesh axes (MeshAxis values), outermost first: pipeline, data, (spatial or subgraph, when > 1),
        (context, when > 1), tensor (innermost, inside a node).

        Context sits next to tensor, as Megatron-LM orders them: its ring exchanges are the
        busiest traffic after tensor parallelism's, so its groups stay within a node where they fit."""
        return dict(self._mesh_axes)

    @property
    def mesh_items(self) -> tuple[tuple[str, int], ...]:
        """`mesh` as (axis, size) pairs, hashable (a cache key of everything the mesh fixes), made once."""
        return self._mesh_axes

    @functools.cached_property
    def _mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """`mesh` as (axis, size) pairs, worked out once per config (the search asks for it often)."""
        # the sub-grids of one data replica sit next to each other, so their collectives stay in a node
        middle = ({MeshAxis.SPATIAL: self.spatial} if self.spatial > 1 else
                  {MeshAxis.SUBGRAPH: self.subgraph} if self.subgraph > 1 else {})
        context = {MeshAxis.CONTEXT: self.context} if self.context > 1 else {}
        axes = {MeshAxis.PIPELINE: self.pipeline, MeshAxis.DATA: self.data, **middle, **context,
                MeshAxis.TENSOR: self.tensor}
        return tuple((a.value, n) for a, n in axes.items())   # plain strings: reprs and messages stay readable
