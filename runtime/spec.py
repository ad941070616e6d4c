"""What a rank needs besides its Program: the training setup and its stages' specs.

`TrainSpec` is the build's training setup (build.json): which model and data
factories, seeds, loss, optimizer, how parameters are initialised.
`StageSpec` describes one pipeline stage's generated module: what it
receives and sends (local shapes for one micro-batch), which modules of the
model it calls, and how tensor parallelism splits them.

Initialisation (`TrainSpec.init`), and what each is bit-equal to:
  "seed":       every rank builds the whole model on the CPU after
                torch.manual_seed(seed) and keeps its slice. Equal to
                `torch.manual_seed(seed); factory(**kwargs)` in one process.
                Simple and exact; for models that fit in one host's memory.
  "per-module": the model is built on meta; each rank materializes only the
                modules its stage calls (to_empty + reset_parameters() under a
                seed derived from the module's path) and slices them. Equal to
                the reference built the same way (runtime.materialize.build_model
                with init="per-module"), not to factory() under one global seed.
  "checkpoint": the model is built on meta and each rank reads its modules'
                tensors from a state_dict file (torch.save), then slices them.
                Equal to loading that file into the single-process model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.datasets import DatasetSpec
from runtime.execute.evaluation import EvalSpec
from runtime.execution import Execution
from runtime.execute.lr_schedule import ScheduleSpec
from runtime.execute.loss_scale import LossScaleSpec
from runtime.execute.optim import OptimizerSpec
from runtime.execute.output_head import OutputHead
from runtime.parallel.parts import STAGE_PARTS
from runtime.program.parts import find_part, put_part
from runtime.program.step_work import StepWork
from runtime.program.shards import FeatureSplit, ModuleShard, ParamShard, shard_dim
from runtime.vocab import DType, RecomputeMode
from runtime.documents import read_document, refuse_unknown_fields

INITS = ("seed", "per-module", "checkpoint")


def computes_grad_norm(reported: bool, clip_grad: float | None, loss_scaled: bool) -> bool:
    """Whether each step computes the global gradient norm: reported (TrainSpec.grad_norm), or needed to clip
    or to check fp16 loss scaling for overflow (the one rule the runtime and the cost model follow)."""
    return reported or clip_grad is not None or loss_scaled


class SpecError(ValueError):
    """A build file or spec that is malformed; the message names the field."""


@dataclass(frozen=True)
class TrainSpec:
    """The training setup every rank and the reference share.

    Attributes:
        model_ref / model_kwargs: factory ("examples/models/gpt.py:build") and its arguments.
        data_ref / data_kwargs: batch factory fn(batch_size, seed, **kw) -> ((inputs...), targets).
        dataset: a torch Dataset by reference (runtime.datasets.DatasetSpec), read instead of the
            batch factory when set.
        global_batch_size: samples per optimizer step over all data ranks.
        seed: parameter initialisation seed; data_seed + step seeds each step's batch.
        loss: "cross_entropy" or "mse"; optimizer: OptimizerSpec; schedule: its lr schedule (ScheduleSpec).
        init: "seed", "per-module" or "checkpoint" (see module docstring); checkpoint: its file.
        dtype: "fp32", or "bf16"/"fp16" for autocast mixed precision (fp32 master weights).
        clip_grad: clip the global gradient norm to this (None: no clipping; runtime/execute/grad_step.py).
        grad_norm: compute the global gradient norm every step, for metrics.jsonl's grad_norm and --verify's
            check of it; False: only where the step needs it (clipping, fp16 loss scaling), which saves a
            read of every gradient per step (the lines then hold a null grad_norm). Written to the build
            only when False, so builds made before it read alike.
        loss_scale: fp16 dynamic loss scaling (runtime/execute/loss_scale.py), or None.
        root: directory that relative refs and paths are resolved against.
        eval: held-out evaluation during training (runtime/execute/evaluation.py), or None.
        work: FLOPs, peak FLOP/s and tokens of one step, for metrics.jsonl's rates (runtime/program/step_work.py);
            None in builds made without it (their lines have null tokens_per_s and mfu).
        execution: how the stages' compute runs (runtime/execution.py: compiled stages, the fused
            chunked loss, the padded vocabulary); builds made without it run the defaults.
    """

    model_ref: str
    data_ref: str
    global_batch_size: int
    model_kwargs: dict = field(default_factory=dict)
    data_kwargs: dict = field(default_factory=dict)
    seed: int = 0
    data_seed: int = 1000
    loss: str = "cross_entropy"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    init: str = "seed"
    checkpoint: str | None = None
    dtype: str = DType.FP32.value
    root: str = ""
    dataset: DatasetSpec | None = None
    eval: EvalSpec | None = None
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    clip_grad: float | None = None
    grad_norm: bool = True
    loss_scale: LossScaleSpec | None = None
    work: StepWork | None = None
    execution: Execution = field(default_factory=Execution)

    def __post_init__(self) -> None:
        self.schedule.check_lr(self.optimizer.lr)
        if not isinstance(self.execution, Execution):
            raise SpecError(f"execution must be an Execution, got {type(self.execution).__name__}")
        if self.init not in INITS:
            raise SpecError(f"unknown init {self.init!r}; known: {', '.join(INITS)}")
        if self.init == "checkpoint" and not self.checkpoint:
            raise SpecError("init 'checkpoint' needs the checkpoint file (a torch.save'd state_dict)")
        try:
            DType(self.dtype)
        except ValueError:
            raise SpecError(f"unknown dtype {self.dtype!r}; known: {', '.join(DType)}") from None
        if not isinstance(self.global_batch_size, int) or self.global_batch_size < 1:
            raise SpecError(f"global_batch_size must be a positive integer, got {self.global_batch_size!r}")
        if self.clip_grad is not None and not (isinstance(self.clip_grad, (int, float)) and
                                               0 < self.clip_grad < float("inf")):
            raise SpecError(f"clip_grad must be a positive finite norm, got {self.clip_grad!r}")
        if not isinstance(self.grad_norm, bool):
            raise SpecError(f"grad_norm must be true or false, got {self.grad_norm!r}")
        if self.loss_scale is not None and self.dtype != DType.FP16:
            raise SpecError(f"loss scaling is for dtype fp16 (float16's narrow range), this build is {self.dtype}; "
                            "leave loss_scale out")
        from runtime.losses import known_loss

        known_loss(self.loss)

    def replace(self, **changes: Any) -> "TrainSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["optimizer"] = self.optimizer.to_dict()
        d["dataset"] = self.dataset.to_dict() if self.dataset is not None else None
        d["eval"] = self.eval.to_dict() if self.eval is not None else None
        d["schedule"] = self.schedule.to_dict()
        d["loss_scale"] = self.loss_scale.to_dict() if self.loss_scale is not None else None
        d["work"] = self.work.to_dict() if self.work is not None else None
        d["execution"] = self.execution.to_dict()
        if self.grad_norm:   # the default: left out, as builds made before the option have it
            del d["grad_norm"]
        return d

    @property
    def needs_grad_norm(self) -> bool:
        """Whether each step computes the global gradient norm: reported (grad_norm), or needed to clip or to
        check fp16 loss scaling for overflow."""
        return computes_grad_norm(self.grad_norm, self.clip_grad, self.loss_scale is not None)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainSpec":
        refuse_unknown_fields(d, cls, "build", SpecError)
        d = dict(d)
        d["optimizer"] = OptimizerSpec.from_dict(d.get("optimizer", {}))
        d["dataset"] = DatasetSpec.from_dict(d["dataset"]) if d.get("dataset") is not None else None
        d["eval"] = EvalSpec.from_dict(d["eval"]) if d.get("eval") is not None else None
        d["schedule"] = ScheduleSpec.from_dict(d.get("schedule", {}))
        if d.get("loss_scale") is not None:
            d["loss_scale"] = LossScaleSpec.from_dict(d["loss_scale"])
        try:
            d["work"] = StepWork.from_dict(d["work"]) if d.get("work") else None
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError(f"build field 'work' ({d['work']!r}): {e!r}; make the build again") from None
        try:   # builds made before execution options run the defaults
            d["execution"] = Execution.from_dict(d.get("execution") or {}, "build field 'execution'")
        except ValueError as e:
            raise SpecError(f"{e}; make the build again") from None
        try:
            return cls(**d)
        except TypeError as e:
            raise SpecError(f"build spec: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "TrainSpec":
        return cls.from_dict(read_document(path, "build file", error=SpecError))


@dataclass(frozen=True)
class Boundary:
    """A tensor crossing into or out of a stage, for one micro-batch, as this rank holds it.

    source: for a stage input, "recv" (from the previous stage) or "data" (read from the data
    factory: the model's positional input `data_index`, or its keyword input `data_key` when
    the factory's batches are dicts); "send" for a stage output.
    requires_grad: a gradient travels back for it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    source: str = "recv"
    data_index: int = -1
    data_key: str = ""

    @property
    def nbytes(self) -> int:
        import torch

        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class StageSpec:
    """One stage's generated module and how to build it on a rank.

    Attributes:
        index: stage (chunk) number; layers: the model's layer names it runs.
        inputs: positional arguments of the stage's forward, in order.
        outputs: the tensors it sends to the next stage (empty for the last stage,
            which returns the model's output).
        modules: model module paths its code calls; attributes: parameter and buffer
            paths it reads directly (get_attr).
        shards: tensor-parallel splits of its modules (empty without tensor parallelism).
        param_shards: tensor-parallel splits of the attributes it reads directly (ATen graphs).
        running_stats: its BatchNorm running statistics (buffer names), averaged over the data
            ranks after every step (runtime/execute/running_stats.py).
        output_split: on the last stage, how the model output's last dimension is split
            over the tensor axis (vocabulary-parallel logits), else None.
        recompute: a runtime.vocab.RecomputeMode value (the generated code applies it).
        parts: the strategies' parts of the stage (runtime/parallel/parts.py STAGE_PARTS: what its code was
            written for; spatial parallelism's tiling, runtime.parallel.spatial.geometry.SpatialSpec, also
            read as `spatial`), each under its key in the document.
        shared: the model's names of each parameter this stage holds that the model uses under
            several names (tied weights), canonical name first. The stage module holds one
            copy, under one of those names; other stages may hold copies too (runtime/execute/ties.py).
        head: on the last stage, its output layer when the model's output is a final linear layer's
            (runtime/execute/output_head.py; with `head.fused` the stage returns the hidden state and the loss
            is fused with the layer), else None.
        padded: the stage's tensors whose rows are padded at tensor degree 1 (Execution.vocab_multiple:
            the output layer's weight and bias, a tied embedding): (name, dimension, split of one rank
            with its multiple); the tensor-parallel path pads through its own splits instead.
        compiled: the methods of the stage class the runtime runs through torch.compile (its layers;
            repeated layers share one method, so one compiled function serves every copy).
    """

    index: int
    layers: tuple[str, ...]
    inputs: tuple[Boundary, ...]
    outputs: tuple[Boundary, ...]
    modules: tuple[str, ...]
    attributes: tuple[str, ...] = ()
    shards: tuple[ModuleShard, ...] = ()
    is_last: bool = False
    output_split: FeatureSplit | None = None
    recompute: str = RecomputeMode.NONE.value
    parts: tuple[Any, ...] = ()
    shared: tuple[tuple[str, ...], ...] = ()
    param_shards: tuple[ParamShard, ...] = ()
    running_stats: tuple[str, ...] = ()
    head: OutputHead | None = None
    padded: tuple[ParamShard, ...] = ()
    compiled: tuple[str, ...] = ()

    def part(self, key: str) -> Any:
        """The strategy part stored under `key`, or None."""
        return find_part(self.parts, key)

    def with_part(self, part: Any) -> "StageSpec":
        """This spec with `part` added (or put in place of the part under the same key)."""
        return dataclasses.replace(self, parts=put_part(self.parts, part, STAGE_PARTS))

    @property
    def spatial(self) -> Any:
        """Spatial parallelism's part (its tiling), or None: as specs had it as a field."""
        return self.part("spatial")

    def split_of(self, name: str, ndim: int) -> tuple[int, FeatureSplit] | None:
        """(dimension, FeatureSplit) of this stage's tensor `name` (a parameter or buffer of
        `ndim` dimensions) under tensor parallelism, or None when every tensor rank holds it whole."""
        for ps in self.param_shards:
            if ps.name == name:
                return ps.dim, ps.split
        path, _, leaf = name.rpartition(".")
        for sh in self.shards:
            if sh.path == path:
                dim = shard_dim(sh.role, leaf, ndim)
                return None if dim is None else (dim, sh.split)
        for ps in self.padded:
            if ps.name == name:
                return ps.dim, ps.split
        return None

    def canonical(self, name: str) -> str:
        """The model's canonical name of this stage's parameter `name` (itself unless tied)."""
        for grp in self.shared:
            if name in grp:
                return grp[0]
        return name

    def to_dict(self) -> dict:
        return {
            "index": self.index, "layers": list(self.layers),
            "inputs": [_bdict(b) for b in self.inputs], "outputs": [_bdict(b) for b in self.outputs],
            "modules": list(self.modules), "attributes": list(self.attributes),
            "shards": [s.to_dict() for s in self.shards], "is_last": self.is_last,
            "output_split": self.output_split.to_list() if self.output_split else None,
            "recompute": self.recompute,
            **{kind.key: (p.to_dict() if (p := self.part(kind.key)) else None) for kind in STAGE_PARTS},
            "shared": [list(g) for g in self.shared],
            "param_shards": [p.to_dict() for p in self.param_shards],
            "running_stats": list(self.running_stats),
            # written only when present, so that the specs of earlier builds read (and compare) unchanged
            **({"head": self.head.to_dict()} if self.head is not None else {}),
            **({"padded": [p.to_dict() for p in self.padded]} if self.padded else {}),
            **({"compiled": list(self.compiled)} if self.compiled else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "StageSpec":
        return cls(
            index=int(d["index"]), layers=tuple(d["layers"]),
            inputs=tuple(_bload(b) for b in d["inputs"]), outputs=tuple(_bload(b) for b in d["outputs"]),
            modules=tuple(d["modules"]), attributes=tuple(d.get("attributes", ())),
            shards=tuple(ModuleShard.from_dict(s) for s in d.get("shards", ())),
            is_last=bool(d.get("is_last", False)),
            output_split=FeatureSplit.from_list(d["output_split"]) if d.get("output_split") else None,
            recompute=d.get("recompute", RecomputeMode.NONE.value),
            parts=tuple(kind.from_dict(d[kind.key]) for kind in STAGE_PARTS if d.get(kind.key)),
            shared=tuple(tuple(str(n) for n in g) for g in d.get("shared", ())),
            param_shards=tuple(ParamShard.from_dict(p) for p in d.get("param_shards", ())),
            running_stats=tuple(str(n) for n in d.get("running_stats", ())),
            head=OutputHead.from_dict(d["head"]) if d.get("head") else None,
            padded=tuple(ParamShard.from_dict(p) for p in d.get("padded", ())),
            compiled=tuple(str(n) for n in d.get("compiled", ())),
        )


def _bdict(b: Boundary) -> dict:
    return {"name": b.name, "shape": list(b.shape), "dtype": b.dtype, "requires_grad": b.requires_grad,
            "source": b.source, "data_index": b.data_index, "data_key": b.data_key}


def _bload(d: dict) -> Boundary:
    return Boundary(d["name"], tuple(d["shape"]), d["dtype"], bool(d["requires_grad"]), d.get("source", "recv"),
                    int(d.get("data_index", -1)), str(d.get("data_key", "")))
