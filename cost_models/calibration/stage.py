"""Fixed costs of the runtime's own steps, timed with the runtime itself (one thread).

The planner prices a stage as the sum of its ops. What a rank actually runs per
instruction has costs no op carries, and on small models they are most of a step:

- a stage call: runtime.execute.stage.StageRunner.forward / .backward (detaching the inputs,
  keeping what backward needs, starting the autograd engine): `time_stage_calls`;
- the loss on the last stage (cross-entropy over the logits, reading it back as a float,
  scaling it before backward), which is not in the captured graph at all: `time_stage_calls`,
  as the difference between a last stage and the same modules as a middle stage, at two
  logits sizes (a fixed part and a part per logits element);
- ZERO_GRAD: zeroing gradient tensors or flat buckets: `time_zero_grad`;
- what a strategy's runtime adds besides its collectives (its calibration_cases; tensor parallelism: the
  autograd functions around the in-layer all-reduces of column- and row-parallel layers, the
  vocabulary-parallel embedding's masking and the vocabulary-parallel loss): `time_strategy_extras`.

Each figure is a median of repeated calls of one variant in a row, as a step repeats the
same stage for its micro-batches (alternating variants would leave every call's caches
cold and overstate the fixed cost).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from cost_models.calibration.ops import one_thread
from runtime.losses import compute_loss
from runtime.spec import Boundary, StageSpec
from runtime.execute.stage import StageRunner
from runtime.parallel.registry import STRATEGIES as RUNTIME_STRATEGIES

WIDTH = 96                   # features of the reference stage's layers (no example model's width)
ROWS = 2                     # samples per micro-batch
LAYERS = (1, 5)              # the two depths whose difference is the cost of the layers
LOSS_SHAPES = ((2, 16), (64, 1024))  # (rows, classes) of the logits: 32 and 65,536 elements


def _median_calls(once: Callable[[], tuple[float, float]], reps: int) -> tuple[float, float]:
    """Median (forward s, backward s) of `reps` calls after warm-up calls."""
    for _ in range(max(reps // 10, 5)):
        once()
    fs, bs = [], []
    for _ in range(reps):
        f, b = once()
        fs.append(f)
        bs.append(b)
    return statistics.median(fs), statistics.median(bs)


def _stage_once(layers: int, classes: int | None, rows: int, last: bool) -> Callable[[], tuple[float, float]]:
    """One forward + backward of a StageRunner over `layers` x (Linear, ReLU) and, when `classes`,
    a Linear head to that many classes; as the last stage (cross-entropy loss) or a middle one."""
    runner = reference_runner(0, layers, WIDTH, rows, classes, last, "recv", 0.25)
    width = classes if classes is not None else WIDTH
    return runner_calls(runner, torch.randn(rows, WIDTH), torch.randint(0, width, (rows,)), torch.randn(rows, width))


def reference_runner(index: int, layers: int, width: int, rows: int, classes: int | None, last: bool,
                     source: str, loss_scale: float):
    """A StageRunner of stage `index` over `layers` x (Linear, ReLU) of `width` features and, when
    `classes`, a Linear head to that many classes; the last stage (cross-entropy loss) or one
    that sends its output. Its input of `rows` samples comes from `source` ("recv" or "data")."""
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    out_width = width
    if classes is not None:
        mods.append(torch.nn.Linear(width, classes))
        out_width = classes
    inp = Boundary("x", (rows, width), "float32", source != "data", source, 0 if source == "data" else -1)
    outs = () if last else (Boundary("y", (rows, out_width), "float32", True, "send"),)
    name = f"ref{index}"
    spec = StageSpec(index, (name,), (inp,), outs, (name,), is_last=last)
    return StageRunner(spec, torch.nn.Sequential(*mods), loss="cross_entropy", loss_scale=loss_scale)


def runner_calls(runner, x, targets, grad) -> Callable[[], tuple[float, float]]:
    """A function timing one forward (with the loss read back on a last stage, as the executor
    does) and one backward of `runner` on input `x`: (forward s, backward s). `targets` is used
    on a last stage, `grad` (the output's gradient) on any other."""
    last = runner.spec.is_last

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = runner.forward(0, [x], targets if last else None)
        if last:  # the executor reads every micro-batch's loss back
            float(out.detach())
        t1 = time.perf_counter()
        runner.backward(0, None if last else [grad])
        return t1 - t0, time.perf_counter() - t1
    return once


def time_stage_calls(*, quick: bool = True) -> dict[str, list]:
    """{"call": [forward s, backward s] of fixed cost per stage call,
        "loss": [[logits elements, forward s, backward s], ...] of the loss at LOSS_SHAPES}.

    call: a middle stage of LAYERS[0] layers less the cost of one layer (from the difference
    of the two depths). loss: a last stage less the same modules as a middle stage."""
    reps = 150 if quick else 600
    with one_thread():
        shallow = _median_calls(_stage_once(LAYERS[0], None, ROWS, False), reps)
        deep = _median_calls(_stage_once(LAYERS[1], None, ROWS, False), reps)
        per = [(d - s) / (LAYERS[1] - LAYERS[0]) for s, d in zip(shallow, deep)]
        call = [max(s - LAYERS[0] * p, 0.0) for s, p in zip(shallow, per)]
        loss = []
        for rows, classes in LOSS_SHAPES:
            middle = _median_calls(_stage_once(1, classes, rows, False), reps // 2)
            last = _median_calls(_stage_once(1, classes, rows, True), reps // 2)
            loss.append([rows * classes, max(last[0] - middle[0], 0.0), max(last[1] - middle[1], 0.0)])
    return {"call": call, "loss": loss}


def time_zero_grad(*, tensors: int = 32, numel: int = 16, big_bytes: int = 4 << 20, reps: int = 60) -> list[float]:
    """[seconds per tensor, seconds per byte] of zeroing gradients in place (Tensor.zero_):
    the mean over `reps` of zeroing `tensors` tiny tensors, over their count; and of zeroing one
    `big_bytes` fp32 tensor, less one tiny tensor's time, over its bytes."""
    small = [torch.ones(numel) for _ in range(tensors)]
    big = torch.ones(big_bytes // 4)
    with one_thread():
        for _ in range(3):
            big.zero_()
            for t in small:
                t.zero_()
        t0 = time.perf_counter()
        for _ in range(reps):
            for t in small:
                t.zero_()
        per_tensor = (time.perf_counter() - t0) / reps / tensors
        t0 = time.perf_counter()
        for _ in range(reps):
            big.zero_()
        per_byte = max((time.perf_counter() - t0) / reps - per_tensor, 0.0) / big_bytes
    return [per_tensor, per_byte]


def time_strategy_extras(*, quick: bool = True) -> dict[str, dict[str, list]]:
    """What the strategies' runtime costs beyond the same ops unsplit (their calibration_cases, e.g. the
    tensor-parallel layers' autograd wrappers, the vocabulary-parallel embedding and loss), at two sizes each:

        {strategy's calibration_key: {part: [[elements, forward s, backward s], ...]}}

    Each figure is the median call of the strategy's variant less the plain one's (clamped at 0), divided
    by the case's figures per call. None of it is in the captured graph; planner.evaluate and the simulator
    add it (the collectives themselves are priced by the communication model)."""
    reps = 200 if quick else 800

    def timed(fwd) -> Callable[[], tuple[float, float]]:
        def once() -> tuple[float, float]:
            t0 = time.perf_counter()
            y = fwd()
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            return t1 - t0, time.perf_counter() - t1
        return once

    def extra(n: int, split, plain, per: int) -> list[float]:
        a, b = _median_calls(timed(split), reps), _median_calls(timed(plain), reps)
        return [float(n)] + [max(x - y, 0.0) / per for x, y in zip(a, b)]

    out: dict[str, dict[str, list]] = {}
    with one_thread():
        for strategy in RUNTIME_STRATEGIES:
            parts = strategy.calibration_cases(LOSS_SHAPES)
            if parts:
                out[strategy.calibration_key] = {part: [extra(*case) for case in cases] for part, cases in parts.items()}
    return out


def fit_loss(points: list[list[float]]) -> tuple[tuple[float, float], tuple[float, float]]:
    """((forward fixed s, forward s per element), (backward fixed, backward per element)) through
    the smallest and largest of [elements, forward s, backward s] points (time_stage_calls' loss,
    time_strategy_extras' figures); both parts clamped to >= 0."""
    (n0, f0, b0), (n1, f1, b1) = sorted(points)[:1] + sorted(points)[-1:]
    if n1 <= n0:
        return (f0, 0.0), (b0, 0.0)

    def line(y0: float, y1: float) -> tuple[float, float]:
        slope = max((y1 - y0) / (n1 - n0), 0.0)
        return max(y0 - slope * n0, 0.0), slope
    return line(f0, f1), line(b0, b1)
