"""What each target runs, so that the search never picks a plan its target cannot run.

A target (runtime.vocab.Target) is what carries a plan out: meshplan's own runtime, or PyTorch's
parallel stack (DeviceMesh, DTensor, FSDP2, torch.distributed.pipelining) through
planner.parallelize and the torch script. The cost model may price more than a target runs;
`optimize` searches only what the target's `RuntimeSupport` allows unless asked for a what-if
search with `runtime=None`, and `check_target` refuses a plan its target does not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cost_models.overlap import OverlapPreset
from planner.config import ConfigError, ParallelConfig
from planner.strategies.combinations import Level
from planner.strategies.combinations import why_not as combination_refusal
from planner.strategies.fields import FIELDS
from planner.strategies.base import GraphSplits
from planner.strategies.registry import STRATEGIES, node_splitter
from runtime.vocab import Backend, DType, OpKind, Schedule, Target

if TYPE_CHECKING:
    from planner.plan import Plan

# Why the torch target leaves an option out (the part of a refusal after the colon), by the option's key in
# RuntimeSupport._refusal; for a strategy it leaves out, its fields module's `torch_gap`
# (planner/strategies/<name>/fields.py). Checked against torch 2.13's sources: torch/distributed/pipelining/
# schedules.py, torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch/amp/grad_scaler.py.
_TORCH_WHY: dict[str, str] = {
    # Megatron's selective recompute (Korthikanti et al. 2022, section 5) frees attention's QK^T scores and
    # softmax; a torch.utils.checkpoint policy keeps or recomputes outputs by op, and the one that keeps the
    # matrix products (create_selective_checkpoint_contexts) keeps the scores, a matrix product themselves
    "recompute": "a selective torch.utils.checkpoint policy that keeps the matrix products (the closest torch has to "
                 "Megatron's selective recompute) still keeps attention's (batch, heads, T, T) scores where "
                 "attention runs as matmuls, which Megatron's selective recompute frees and the cost model counts "
                 "as freed",
    # torch/amp/grad_scaler.py reduces found_inf over nothing; FSDP's ShardedGradScaler all-reduces it over one
    # process group
    "dtype": "fp16 needs dynamic loss scaling whose overflow check agrees on every rank, and torch.amp.GradScaler "
             "checks only this rank's gradient shards (FSDP's ShardedGradScaler is not proven with "
             "tensor-parallel DTensor gradients)",
    "backend": "meshplan's MPI path (mpi4py) belongs to its own runtime; PyTorch's stack runs on gloo or NCCL "
               "process groups",
    # fully_shard cuts the rank's [q_r, k_r, v_r] rows into contiguous pieces, which no DTensor placement
    # describes: the full parameter (full_tensor, state dicts, DCP) would come out wrong
    "fully_shard_part_splits": "FSDP2's fully_shard cannot shard a weight that tensor parallelism splits by "
                               "parts (a fused projection whose rank r holds q_r, k_r and v_r)",
    "tensor_in_pipelines": "its pipeline stages (codegen/torch_target/pipeline.py) take no tensor-parallel "
                           "styles yet",
    # Schedule1F1B.__init__ raises unless n_microbatches >= the number of stages
    "schedule": "torch.distributed.pipelining's Schedule1F1B needs at least as many micro-batches as pipeline "
                "stages",
}


class TargetError(ConfigError):
    """An unknown target, or a plan or configuration its target does not run; the message names the target
    and the strategy, and says what to change."""


def as_target(value: Any) -> Target:
    """`value` (a Target or its string) as a Target; TargetError listing the targets otherwise."""
    try:
        return Target(value)
    except ValueError:
        raise TargetError(f"target {value!r} is not one of {', '.join(Target)}: meshplan runs a plan with "
                          "meshplan's own runtime, torch with PyTorch's DeviceMesh/DTensor/FSDP2/pipelining "
                          "stack") from None


@dataclass(frozen=True)
class RuntimeSupport:
    """The configurations a target executes exactly (for meshplan's runtime, proven by tests/distributed).

    `stack` is the overlap preset (cost_models/overlap.py) that describes what the target's stack hides
    behind compute, the one the search prices with unless told otherwise. `fill_1f1b`: the 1f1b schedule
    needs at least as many micro-batches per step as pipeline stages.
    """

    target: Target = Target.MESHPLAN
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
    recompute: tuple[str, ...] = ("none", "selective", "full")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    # fp16 trains with dynamic loss scaling (runtime/execute/loss_scale.py); bf16 and fp32 need none. Held as
    # strings, like the backends: a refusal quotes them (_one_of), and a member's repr is not its text.
    dtypes: tuple[str, ...] = tuple(d.value for d in DType)
    # the strategies (StrategyName values) the target leaves out. meshplan's runtime runs them all: GEMS
    # pipelines (tests/distributed/test_bidirectional.py), spatial tiles (test_spatial_build.py), sub-graph
    # parallelism (test_subgraph.py), context parallelism (test_context_parallel.py); the compositions each runs
    # are the RUNTIME rules of planner/strategies/combinations.py, the others are priced, not run.
    not_run: tuple[str, ...] = ()
    backends: tuple[str, ...] = tuple(b.value for b in Backend)
    stack: OverlapPreset = OverlapPreset.MESHPLAN
    fill_1f1b: bool = False
    # the op kinds (planner/graph/ops.py) whose weights the target splits over the tensor axis; None: every
    # kind the split analysis accepts
    split_kinds: tuple[OpKind, ...] | None = None
    tensor_in_pipelines: bool = True   # pipeline stages split over a tensor axis
    fully_shard_part_splits: bool = True   # ZeRO over data ranks with a fused projection split by parts

    @classmethod
    def for_target(cls, target: Target | str) -> "RuntimeSupport":
        """What `target` runs (a Target or its string; TargetError listing the targets otherwise)."""
        return {Target.MESHPLAN: MESHPLAN_RUNTIME, Target.TORCH: TORCH_RUNTIME}[as_target(target)]

    def allows(self, config: ParallelConfig, global_batch_size: int | None = None) -> bool:
        return self.why_not(config, global_batch_size) is None

    def why_not(self, config: ParallelConfig, global_batch_size: int | None = None) -> str | None:
        """A sentence naming this target and what it cannot run in `config` (and, given the global batch in
        samples, in its micro-batches), with what to change, another target that runs it included; or None."""
        why = self._own_refusal(config, global_batch_size)
        if why is None:
            return None
        others = [t.value for t in Target if t != self.target
                  and RuntimeSupport.for_target(t)._own_refusal(config, global_batch_size) is None]
        return why + (f", or plan for the {' or '.join(others)} target" if others else "")

    def _own_refusal(self, config: ParallelConfig, global_batch_size: int | None) -> str | None:
        off = next((s.name for s in STRATEGIES if s.name in self.not_run and s.active(config)), None)
        if off is not None:
            f = next(f for f in FIELDS if f.name == off)
            return self._refusal(off, f.title, f"use {f.off_setting}", why=f.torch_gap)
        if config.schedule not in self.schedules:
            return self._refusal("schedule", f"the {config.schedule} schedule", _one_of("schedule", self.schedules))
        if config.recompute not in self.recompute:
            return self._refusal("recompute", f"recompute={config.recompute!r}",
                                 _one_of("recompute", self.recompute))
        if config.zero not in self.zero_stages:
            return self._refusal("zero", f"ZeRO stage {config.zero}", _one_of("zero", self.zero_stages))
        # meshplan's runtime rules (combinations.py); they name only strategies the torch target switches off
        refusal = combination_refusal(config, Level.RUNTIME)
        if refusal:
            return refusal
        splitter = node_splitter()
        if not self.tensor_in_pipelines and config.pipeline > 1 and (t := splitter.split_ranks(config)) > 1:
            return self._refusal("tensor_in_pipelines", f"pipeline {config.pipeline} with {splitter.name} {t} "
                                 "inside its stages", f"use pipeline=1 or {splitter.name}=1")
        if config.dtype not in self.dtypes:
            return self._refusal("dtype", f"{config.dtype} training", _one_of("dtype", self.dtypes))
        if self.fill_1f1b and global_batch_size is not None and config.pipeline > 1 \
                and config.schedule == Schedule.ONE_F_ONE_B:
            m = global_batch_size // (config.micro_batch_size * config.data)
            if m < config.pipeline:
                return self._refusal("schedule", f"1f1b with {m} micro-batches (global batch {global_batch_size} / "
                                     f"(micro_batch_size {config.micro_batch_size} x data {config.data})) on "
                                     f"pipeline {config.pipeline}",
                                     "use schedule='gpipe', a smaller micro-batch or a larger batch")
        return None

    def why_not_splits(self, config: ParallelConfig, splits) -> str | None:
        """A sentence naming this target and what it cannot run in `config` with the tensor-parallel split
        `splits` (planner/tensor_split TensorSplits, None where nothing is split, or a function giving them,
        called only when `config` could be refused) the plan makes; or None."""
        t = node_splitter().split_ranks(config)
        if self.fully_shard_part_splits or t == 1 or config.data == 1 or config.zero == 0:
            return None
        splits = splits() if callable(splits) else splits
        parts = () if splits is None else splits.part_splits()
        if parts:
            return self._refusal("fully_shard_part_splits", f"ZeRO {config.zero} with module {parts[0]!r} split by "
                                 f"parts over {t} tensor ranks",
                                 "use zero=0, or write the fused projection as separate Linears")
        return None

    def why_not_backend(self, backend: str) -> str | None:
        """A sentence naming this target and the communication `backend` ("gloo", "nccl", "mpi") if it does not
        run on it; None if it does."""
        if backend in self.backends:
            return None
        others = [t.value for t in Target if t != self.target and backend in RuntimeSupport.for_target(t).backends]
        return self._refusal("backend", f"on the {backend} backend", _one_of("backend", self.backends)) + (
            f", or plan for the {' or '.join(others)} target" if others else "")

    def _refusal(self, key: str, what: str, advice: str, why: str | None = None) -> str:
        """"the <target> target does not run <what>: <why>; <advice>" (why, on the torch target: `why`, or
        _TORCH_WHY's)."""
        why = (why or _TORCH_WHY.get(key)) if self.target == Target.TORCH else None
        return f"the {self.target} target does not run {what}" + (f": {why}" if why else "") + f"; {advice}"

    def splittable(self, graph, sharding: GraphSplits, degrees) -> GraphSplits:
        """`sharding` without the split regions the code generator cannot split for any of the split `degrees`
        (Strategy.target_splits of the strategy that splits nodes), given the op kinds this target splits."""
        return node_splitter().target_splits(graph, sharding, degrees, self.split_kinds)


def _one_of(name: str, allowed: tuple) -> str:
    """"use name='a' or name='b'" for the values `allowed`."""
    return "use " + " or ".join(f"{name}={a!r}" for a in allowed)


def check_target(plan: "Plan", target: Target | str | None = None, *, backend: str | None = None) -> None:
    """TargetError unless `target` (default: the target the plan was made for) runs `plan`, on `backend`
    ("gloo", "nccl", "mpi") where given. What codegen calls before it writes a build for a target."""
    support = RuntimeSupport.for_target(plan.target if target is None else target)
    why = support.why_not(plan.config, plan.global_batch_size) or \
        support.why_not_splits(plan.config, plan.tensor_splits) or (
        support.why_not_backend(backend) if backend is not None else None)
    if why:
        raise TargetError(f"plan {plan.config.short()}: {why}")


MESHPLAN_RUNTIME = RuntimeSupport()
# PyTorch's stack (planner.parallelize and the torch script): replicate or fully_shard for data parallelism and
# ZeRO, DTensor ColwiseParallel/RowwiseParallel (defined for nn.Linear and nn.Embedding only,
# torch/distributed/tensor/parallel/style.py: split_kinds) and SequenceParallel, PipelineStage with ScheduleGPipe,
# Schedule1F1B or ScheduleInterleaved1F1B, torch.utils.checkpoint per block; why each other option is left
# out: _TORCH_WHY. torchtitan's overlap preset describes the same stack (FSDP2 prefetch, pipelining's waits); its
# "torch" twin trains under autocast, as the target's loop does.
TORCH_RUNTIME = RuntimeSupport(target=Target.TORCH, recompute=("none", "full"),
                               dtypes=(DType.FP32.value, DType.BF16.value),
                               not_run=tuple(f.name.value for f in FIELDS if f.torch_gap),
                               backends=(Backend.GLOO.value, Backend.NCCL.value), stack=OverlapPreset.TORCH, fill_1f1b=True,
                               split_kinds=(OpKind.LINEAR, OpKind.EMBEDDING), tensor_in_pipelines=False,
                               fully_shard_part_splits=False)
