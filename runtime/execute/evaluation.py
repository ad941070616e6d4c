"""Held-out evaluation during training: the settings, the forward-only part of a Program, accuracy.

`--eval-every N --eval-batches K`: after every N-th training step (when (step + 1) % N == 0) each
rank runs K held-out global batches (runtime.batch_source.open_data with Split.EVAL; batch j is
`micro_batches(j)`) forward only: the modules in eval() mode, under torch.no_grad, no gradient, no
optimizer. The evaluation loss is the mean of the K batches' global-batch mean losses (the training
loss's definition); for cross_entropy with integer class targets the accuracy is the fraction of
target elements whose argmax over the classes equals the target, over all K batches.

The ranks run the forward part of their own Program (`forward_only`): the forwards, the activations'
sends and receives, ZeRO-3's parameter gathers before a forward, and the loss's all-reduce and
broadcast, which here carry (loss, correct predictions, elements counted) instead of the loss alone.
The single-process reference (runtime/reference.evaluate_model) does the same in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from runtime.program.instr_set import Kind, Op
from runtime.losses import model_output
from runtime.program import Instr, Program
from runtime.documents import read_document

if TYPE_CHECKING:
    from runtime.comm import Group


class EvalError(ValueError):
    """Evaluation settings the runtime cannot use; the message names the setting."""


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EvalError(f"{name} must be a positive whole number, got {value!r}")
    return value


@dataclass(frozen=True)
class EvalSpec:
    """Evaluate after every `every`-th training step, on `batches` held-out global batches."""

    every: int
    batches: int = 1

    def __post_init__(self) -> None:
        _positive("--eval-every", self.every)
        _positive("--eval-batches", self.batches)

    def due(self, step: int) -> bool:
        """Whether an evaluation follows training step `step` (counted from 0)."""
        return (step + 1) % self.every == 0

    def to_dict(self) -> dict:
        return {"every": self.every, "batches": self.batches}

    @classmethod
    def from_dict(cls, d: Mapping) -> "EvalSpec":
        if not isinstance(d, Mapping) or set(d) - {"every", "batches"} or "every" not in d:
            raise EvalError(f"build field 'eval' must be {{'every': N, 'batches': K}}, got {d!r}; "
                            "generate the build again")
        return cls(d["every"], d.get("batches", 1))


def eval_setting(build: EvalSpec | None, every: int | None, batches: int | None) -> EvalSpec | None:
    """The evaluation a run does: the build's, with `meshplan run --eval-every/--eval-batches` overriding
    its fields (None: not given). --eval-batches alone needs a build that evaluates."""
    if every is None and batches is None:
        return build
    if every is None and build is None:
        raise EvalError("--eval-batches needs --eval-every N (the build does not evaluate): give both")
    return EvalSpec(every if every is not None else build.every,
                    batches if batches is not None else (build.batches if build is not None else 1))


# ---- the forward part of a Program ----------------------------------------------------

def _is_forward(ins: Instr, instrs: tuple[Instr, ...], k: int, zero: int) -> bool:
    if ins.op == Op.F:
        return True
    if ins.op in (Op.SEND, Op.RECV):
        return ins.kind == Kind.ACT
    if ins.kind == Kind.LOSS:
        return ins.op in (Op.ALLREDUCE, Op.BROADCAST)
    if ins.op == Op.ALLGATHER and ins.kind == Kind.PARAMS and zero >= 3:
        # ZeRO-3 gathers a stage's parameters before each of its forwards and backwards: keep the
        # forwards' (ZeRO-1/2's gathers follow STEP and refresh updated parameters: none here)
        nxt = next((i for i in instrs[k + 1:] if i.op in (Op.F, Op.B) and i.stage == ins.stage), None)
        return nxt is not None and nxt.op == Op.F
    return False


def forward_only(program: Program) -> tuple[int, ...]:
    """Indices into program.instrs of its forward part, in order: F, SEND/RECV act, the loss's
    ALLREDUCE/BROADCAST, ZeRO-3's ALLGATHER params before a forward, and the WAITs of those; not
    B, gradient sends, gradient/tied/statistics collectives, STEP or ZERO_GRAD.

    Every rank drops the same kinds, so the messages and collectives that remain still pair up."""
    instrs = program.instrs
    keep: list[int] = []
    handles: set[int] = set()
    for k, ins in enumerate(instrs):
        if ins.op == Op.WAIT:
            if ins.handle in handles:
                keep.append(k)
        elif _is_forward(ins, instrs, k, program.zero):
            keep.append(k)
            if ins.handle >= 0:
                handles.add(ins.handle)
    return tuple(keep)


# ---- accuracy -------------------------------------------------------------------------

def _split_argmax(logits: torch.Tensor, start: int, group: "Group", valid: int) -> torch.Tensor:
    """Argmax over class-split logits (..., V/t): the global class index, the lowest among ties (as
    torch.argmax over the whole vocabulary), agreed over the tensor group."""
    local = logits[..., :valid].float()
    if valid > 0:
        idx = local.argmax(-1)
        best = local.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    else:  # this rank holds only padding classes
        best = torch.full(logits.shape[:-1], -torch.inf, device=logits.device)
        idx = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    top = best.clone()
    group.all_reduce(top, op="max")
    never = torch.iinfo(torch.int64).max
    pred = torch.where(best == top, idx + start, torch.full_like(idx, never))
    group.all_reduce(pred, op="min")
    return pred


def count_correct(loss: str, output, targets: torch.Tensor,
                  class_split: tuple[int, "Group", int] | None = None) -> tuple[int, int]:
    """(target elements whose predicted class equals the target, elements counted) of one micro-batch;
    (0, 0) unless the loss is cross_entropy with integer class targets.

    output: logits (..., C) with targets (...), or (N, C, d1, ...) with targets (N, d1, ...) (as
    runtime.losses.compute_loss reads them); class_split: as compute_loss's (vocabulary-parallel
    logits, the argmax taken across the tensor group)."""
    if loss != "cross_entropy" or targets.is_floating_point():
        return 0, 0
    out = model_output(output)
    if class_split is not None:
        start, group, valid = class_split
        pred = _split_argmax(out, start, group, valid)
    elif tuple(out.shape[:-1]) == tuple(targets.shape):
        pred = out.argmax(-1)
    else:
        pred = out.argmax(1)
    return int((pred == targets).sum()), targets.numel()


# ---- results --------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalResult:
    """One evaluation after training step `step`: loss (mean of the batches' global-batch mean
    losses), accuracy (fraction of target elements predicted, None without class targets), and
    `elements`, the target elements the accuracy counts."""

    step: int
    loss: float
    accuracy: float | None
    elements: int = 0

    @classmethod
    def combine(cls, step: int, batches: list[tuple[float, float, float]]) -> "EvalResult":
        """From each batch's (global-batch mean loss, correct predictions, elements counted)."""
        correct = int(round(sum(b[1] for b in batches)))
        counted = int(round(sum(b[2] for b in batches)))
        return cls(step, sum(b[0] for b in batches) / len(batches), correct / counted if counted else None, counted)

    def metrics(self) -> dict:
        """The fields a metrics line carries."""
        return {"eval_loss": self.loss, "eval_accuracy": self.accuracy}

    def to_dict(self) -> dict:
        return {"step": self.step, **self.metrics(), "elements": self.elements}

    @classmethod
    def from_dict(cls, d: Mapping) -> "EvalResult":
        return cls(int(d["step"]), float(d["eval_loss"]),
                   None if d.get("eval_accuracy") is None else float(d["eval_accuracy"]), int(d.get("elements", 0)))

    def line(self) -> str:
        acc = "" if self.accuracy is None else f"  accuracy {self.accuracy:.4f}"
        return f"step {self.step}: eval loss {self.loss:.6f}{acc}"


def evaluate_held_out(executor, spec: EvalSpec, step: int) -> EvalResult:
    """Run `spec.batches` held-out batches through `executor` (runtime/executor.Executor.evaluate_batch),
    its stage modules in eval() mode meanwhile; the same result on every rank."""
    modules = [r.module for r in executor.stages.values()]
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        batches = [tuple(float(x) for x in executor.evaluate_batch(step, j).tolist()) for j in range(spec.batches)]
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
    return EvalResult.combine(step, batches)


def read_run_evals(run_dir: str | Path) -> tuple[EvalSpec | None, list[EvalResult]]:
    """The evaluation setting and results rank 0 recorded in run_dir/rank_0000.json."""
    f = Path(run_dir) / "rank_0000.json"
    if not f.is_file():
        return None, []
    d = read_document(f, "run record", error=EvalError)
    spec = EvalSpec.from_dict(d["eval"]) if d.get("eval") else None
    return spec, [EvalResult.from_dict(e) for e in d.get("evals", ())]


def compare_evals(run: list[EvalResult], ref: list[EvalResult], twin: list[EvalResult], floor: float,
                  margin: float) -> tuple[list[str], float]:
    """(problems, the worst difference as a fraction of its allowance) of the run's evaluations against
    the free-running reference's, by step. The loss may differ by `floor` relative or `margin` times
    a rounding-level twin's distance (as the training loss); the accuracy by one element's prediction
    or `margin` times the twin's distance (rounding may flip an argmax between near-equal logits)."""
    by_step = {e.step: e for e in ref}
    twins = {e.step: e for e in twin}
    problems, worst = [], 0.0
    if sorted(e.step for e in run) != sorted(by_step):
        problems.append(f"evaluation: the run evaluated after steps {[e.step for e in run]}, the reference after "
                        f"{sorted(by_step)}")
    for e in run:
        want, other = by_step.get(e.step), twins.get(e.step)
        if want is None or other is None:
            continue
        d = abs(e.loss - want.loss)
        allow = max(floor * abs(want.loss), margin * abs(other.loss - want.loss), 1e-12)
        worst = max(worst, d / allow)
        if not d <= allow:
            problems.append(f"evaluation after step {e.step}: loss {e.loss:.7g}, the reference's {want.loss:.7g} "
                            f"(|diff| {d:.3g} > {allow:.3g})")
        if (e.accuracy is None) != (want.accuracy is None):
            problems.append(f"evaluation after step {e.step}: accuracy {e.accuracy}, the reference's {want.accuracy}")
        elif e.accuracy is not None:
            d = abs(e.accuracy - want.accuracy)
            allow = max(1.0 / max(want.elements, 1), margin * abs(other.accuracy - want.accuracy)) * (1 + 1e-9)
            worst = max(worst, d / allow)
            if not d <= allow:
                problems.append(f"evaluation after step {e.step}: accuracy {e.accuracy:.6f}, the reference's "
                                f"{want.accuracy:.6f} (|diff| {d:.3g} > {allow:.3g}, one prediction of "
                                f"{want.elements})")
    return problems, worst
