"""What a parallel strategy does at run time: the protocol of runtime/parallel/<name>.py.

The rank's main (runtime/rank_main.py) knows no strategy by name: it loops over the registry
(runtime/parallel/registry.py) at two points, and every hook reads only what the Program and
the StageSpecs say.

    prepare   before this rank talks to any other: drop or reshape what the stage modules hold
              (subgraph: the paths of other sub-grids)
    attach    once the process groups exist: hand the stage modules their groups, or replace
              them (spatial: the tile and its group; tensor: the tensor group; subgraph: the sub-grid group)
    param_place  where this rank sits among the ranks holding slices of the split parameters (tensor:
                 its tensor coordinate), for building the stage modules and restoring checkpoints
    local_module, local_param  this rank's part of a module or parameter the StageSpecs split (tensor:
                 its column/row/vocabulary-parallel layers), as runtime.materialize builds the stage modules
    class_split  how the last stage's logits are split over ranks for the loss (tensor: the
                 vocabulary-parallel cross-entropy)
    batches   the rank's batch source, as its stage code and loss read it (context: the targets
              in the sequence chunks' order)

Two attributes say where a strategy is in use and what the runtime does not do with it:
`axis`, the mesh axis (or the Program's derived axis) whose presence means a Program uses it, and
`not_evaluated`, the plan feature held-out evaluation names when it cannot run on such a Program
(runtime/execute/evaluation.py), None where it can.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import nn

from runtime.comm import Group
from runtime.comm.context import DistContext
from runtime.program import Program
from runtime.program.shards import ModuleShard, ParamShard
from runtime.spec import StageSpec
from runtime.vocab import StrategyName


ClassSplit = tuple[int, Group, int]   # (first class held here, the group, how many classes held here)
# a calibration case: (elements, the strategy's call, the same work without it, figures per call); each call
# returns the tensor backward starts from (cost_models/calibration/stage.py times the difference)
CalibrationCase = tuple[int, Callable[[], torch.Tensor], Callable[[], torch.Tensor], int]
Modules = dict[int, nn.Module]     # stage index -> stage module
Specs = dict[int, StageSpec]       # stage index -> its StageSpec


class RuntimeStrategy(Protocol):
    """One parallel strategy's part in running a Program (see module docstring); subclass it and
    override the hooks the strategy changes."""

    name: StrategyName
    axis: str
    not_evaluated: str | None = None

    def prepare(self, program: Program, specs: Specs, modules: Modules) -> None:
        """Change the stage modules before any communication (same on every rank)."""

    def attach(self, ctx: DistContext, program: Program, specs: Specs, modules: Modules) -> None:
        """Give the stage modules their process groups, or replace entries of `modules`."""

    def param_place(self, program: Program) -> tuple[int, int] | None:
        """(this rank's coordinate, the number of ranks) along the axis whose ranks each hold a slice of the
        split parameters the StageSpecs name (tensor: the tensor axis), or None where this strategy splits
        none. The stage modules, a resumed checkpoint's tensors and the gradient norm's pieces are sliced by it."""
        return None

    def local_module(self, module: nn.Module, shard: ModuleShard, rank: int, num: int) -> nn.Module | None:
        """This rank's part of `module`, which a StageSpec splits as `shard` over `num` ranks (this one `rank`,
        param_place's), its group given later by `attach`; None where this strategy makes no such splits."""
        return None

    def local_param(self, value: torch.Tensor, shard: ParamShard, rank: int,
                    num: int) -> torch.Tensor | None:
        """This rank's slice of `value`, a parameter or buffer the model's code reads directly and a StageSpec
        splits as `shard` (a Parameter stays one); None where this strategy makes no such splits."""
        return None

    def class_split(self, ctx: DistContext, spec: StageSpec) -> ClassSplit | None:
        """The split of stage `spec`'s logits over ranks, for the loss (None: this strategy splits none)."""
        return None

    def batches(self, program: Program, source: Any) -> Any:
        """The batch source (runtime.batch_source.open_data's) the rank trains on."""
        return source

    # what `meshplan calibrate` records this strategy's own runtime costs under, and calls them in its progress
    calibration_key: str | None = None
    calibration_title: str = ""

    def calibration_cases(self, loss_shapes: tuple[tuple[int, int], ...]) -> dict[str, list[CalibrationCase]]:
        """What this strategy's runtime adds beyond the ops it wraps, as cases to time: {part: [CalibrationCase,
        ...]} at two sizes each (loss_shapes: (rows, classes) of the logits, for a loss case); {} where none."""
        return {}

    sabotages: tuple[str, ...] = ()   # the --sabotage faults this strategy offers (runtime/verify/sabotage.py)

    def sabotage(self, what: str, modules: Modules) -> None:
        """Break this strategy's arithmetic as `what` (one of `sabotages`) says, while every message still
        flows: a test's proof that `meshplan run --verify` notices."""
