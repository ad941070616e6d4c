"""`Executor`: runs one rank's Program, one training step at a time.

It keeps a table of asynchronous handles (the Program's h<N>), the
received activations and gradients keyed by (stage, micro-batch), and
records every instruction in the rank's Timeline. It decides nothing: the
order, the peers and the collectives all come from the Program.

A gradient collective that directly follows the last backward of its stage
is armed before that backward and issued from inside it by the bucket's
hook (see runtime/execute/grads.py); when the executor reaches the instruction the
handle already exists.

The host waits for the device once per step: the micro-batches' losses are added
up on the device, and the step's loss (with the global gradient norm, when only
reported) is read back at its end. On CUDA the next step's batch is made while the
device still runs this step's kernels, copied into pinned memory and sent to the
device asynchronously on a side stream (`prefetch`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from runtime.comm import Handle, PeerFailure, p2p_tag
from runtime.comm.context import DistContext
from runtime.data import DataSource, pick_input
from runtime.execute.evaluation import forward_only
from runtime.launch.faults import SAVE_FAULTS, inject
from runtime.execute.grads import GradSync
from runtime.execute.lr_schedule import current_lr
from runtime.execute.grad_step import GradientStep
from runtime.program.instr_set import Kind, Op
from runtime.program import Instr, Program
from runtime.execute.stage import StageRunner
from runtime.execute.running_stats import RunningStats
from runtime.execute.ties import TieSync
from runtime.program.trace import Recorder
from runtime.vocab import MeshAxis, Track


def _as(t: torch.Tensor, dtype: str) -> torch.Tensor:
    want = getattr(torch, dtype)
    return (t if t.dtype == want else t.to(want)).contiguous()


class RankFailure(RuntimeError):
    """An instruction failed on this rank; the message names the rank, step and instruction."""


class _Multi:
    """Several handles completed together (a message of several tensors)."""

    def __init__(self, handles: list[Handle]):
        self._handles = handles

    def wait(self) -> None:
        for h in self._handles:
            h.wait()

    def on_complete(self, fn) -> None:
        if not self._handles:
            fn()
            return
        self._handles[-1].on_complete(fn)


@dataclass
class StepResult:
    """One step's outcome on this rank. loss: the global batch's mean loss; seconds: wall time of the step;
    lr: the learning rate the optimizer stepped with (None on a rank without one); grad_norm: the global
    gradient norm over the whole model, before clipping (None when not computed); loss_scale: the fp16
    loss scale the step's backward used (None without loss scaling); skipped: the optimizer step was
    skipped on every rank (fp16 overflow)."""

    step: int
    loss: float
    seconds: float
    lr: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    skipped: bool = False
    evaluation: dict | None = None   # after an evaluation step: eval_loss, eval_accuracy (runtime/execute/evaluation.py)


@dataclass
class _Walk:
    """One walk over the Program (a training step, or an evaluation batch's forward part): its
    micro-batches, the loss buffer on the device, the open handles (Program h<N> -> Handle), and the
    tensors between instructions, keyed by (stage, micro-batch): activations and gradients received,
    and the outputs and input gradients a SEND takes."""

    step: int
    micro: list | None
    loss_buf: torch.Tensor
    handles: dict[int, Handle] = field(default_factory=dict)
    recv_act: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    recv_grad: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    out_act: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    out_grad: dict[tuple[int, int], list[torch.Tensor | None]] = field(default_factory=dict)


@dataclass
class Executor:
    """Runs `program` with the given stage runners.

    Args:
        program: this rank's Program.
        ctx: the DistContext (groups per axis, communicator).
        stages: stage index -> StageRunner for every stage in program.stages.
        grads: the GradSync of this rank's buckets (None when there is no data axis).
        ties: the TieSync of this rank's tied-weight copies (None when it holds none).
        stats: the RunningStats of this rank's BatchNorm statistics (None when it has none).
        optimizer: steps the parameters GradSync.optimizer_params() lists.
        scheduler: its lr scheduler, stepped after every optimizer step (runtime/execute/lr_schedule.py).
        data: this data rank's batches (None when no stage of this rank reads data).
        recorder: where instruction times go.
        fail_at: (step, instruction index) at which to raise, for failure tests.
    """

    program: Program
    ctx: DistContext
    stages: dict[int, StageRunner]
    grads: GradSync | None
    optimizer: torch.optim.Optimizer | None
    data: DataSource | None
    recorder: Recorder
    fail_at: tuple[int, int] | None = None
    fault: str = "raise"                       # what fail_at does (runtime/launch/faults.py)
    ties: TieSync | None = None
    stats: RunningStats | None = None          # BatchNorm running statistics averaged over the grad axis
    on_step: Callable[[], None] | None = None  # called at STEP after fp16 unscaling, before clipping and the
                                               # optimizer (runtime/verify/step_record.py)
    guard: GradientStep | None = None          # unscale, norm, skip or clip at STEP (runtime/execute/grad_step.py)
    scheduler: object = None                   # torch.optim.lr_scheduler.LRScheduler, with `optimizer`
    position: tuple[int, int] = (-1, -1)       # (step, instruction index) now running, for the watchdog
    eval_data: DataSource | None = None        # held-out batches (runtime/execute/evaluation.py; None: no stage reads data)
    _evaluating: bool = False                  # evaluate_batch is walking the Program's forward part
    _attached: dict[int, list[int]] = field(default_factory=dict)
    _completions: list = field(default_factory=list)
    _held: list | None = None                  # this rank's parameters, listed at the first ZERO_GRAD
    _lr: float | None = None
    _staged: tuple | None = None               # (step, its micro-batches on the device, the copy stream)
    _copy_stream: object = None                # CUDA: the side stream prefetched batches are copied on

    def __post_init__(self) -> None:
        # Gradient collectives that directly follow a stage's last backward are issued by it.
        instrs = self.program.instrs
        for i, ins in enumerate(instrs):
            if ins.op != Op.B:
                continue
            j = i + 1
            if j < len(instrs) and instrs[j].op == Op.SEND and instrs[j].kind == Kind.GRAD:
                j += 1  # the gradient sent to the previous stage sits between them
            while j < len(instrs) and instrs[j].op in (Op.ALLREDUCE, Op.REDUCESCATTER) and instrs[j].kind == Kind.GRADS \
                    and instrs[j].stage == ins.stage:
                self._attached.setdefault(i, []).append(j)
                j += 1
        self.device = self.ctx.device
        self._forward = forward_only(self.program)
        self._names = [str(i) for i in instrs]   # printed once; the recorder stores them per event

    # ------------------------------------------------------------------
    def evaluate_batch(self, step: int, j: int) -> torch.Tensor:
        """Held-out batch j, forward only, after training step `step` (runtime/execute/evaluation.py): the
        Program's forward part, untraced; the caller puts the modules in eval() mode. Returns
        (global-batch mean loss, correct predictions, target elements counted), the same on every rank."""
        micro = self.eval_data.micro_batches(j) if self.eval_data is not None else None
        buf = self._loss_buffer(3)
        traced, self.recorder.enabled = self.recorder.enabled, False
        self._evaluating = True
        try:
            self._walk(self._forward, step, micro, buf)
        finally:
            self._evaluating = False
            self.recorder.enabled = traced
        return buf

    def _loss_buffer(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float64 if self.device.type == "cpu" else torch.float32, device=self.device)

    def _walk(self, indices, step: int, micro, loss_buf: torch.Tensor) -> None:
        """Run the instructions at `indices` of the Program (all of them for a training step)."""
        w = _Walk(step, micro, loss_buf)
        rec = self.recorder
        for idx in indices:
            ins = self.program.instrs[idx]
            self.position = (step, idx)
            # SAVE_FAULTS fire in the save; an evaluation is not a training step's instruction
            if self.fail_at == (step, idx) and self.fault not in SAVE_FAULTS and not self._evaluating:
                if self.fault == "raise":
                    raise RankFailure(f"rank {self.ctx.rank} failed at step {step}, instruction {idx} '{ins}': "
                                      "RuntimeError: injected fault (--fail-at)")
                inject(self.fault, self.ctx.rank, f"step {step}, instruction {idx} '{ins}'")
            start = rec.mark(device=not ins.is_async)
            try:
                self._exec(idx, ins, w)
            except RankFailure:
                raise
            except PeerFailure as e:
                raise PeerFailure(f"{e} (rank {self.ctx.rank} was at step {step}, instruction {idx} '{ins}')") \
                    from None
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise RankFailure(f"rank {self.ctx.rank} failed at step {step}, instruction {idx} '{ins}': "
                                  f"{type(e).__name__}: {first[:400]}") from e
            if not ins.is_async:
                rec.add_interval(step, idx, self._names[idx], ins.op, start, rec.mark())

    def run_step(self, step: int, next_step: int | None = None) -> StepResult:
        """Training step `step`; next_step: the step that follows (its batch is prefetched on CUDA), or None."""
        t0 = time.perf_counter()
        micro = self._batch(step)
        self._lr = None
        loss_buf = self._loss_buffer(1)
        if self.guard is not None:
            self.guard.begin(self.stages)
        self._walk(range(len(self.program.instrs)), step, micro, loss_buf)
        if self.grads is not None:
            self.grads.finish()
        if next_step is not None:   # while the device still runs this step
            self.prefetch(next_step)
        norm = self.guard.pending_norm() if self.guard is not None else None
        if norm is None:
            loss, total = float(loss_buf.item()), None
        else:   # one read back for both
            loss, total = torch.stack((loss_buf.reshape(-1)[0].to(norm.dtype), norm)).tolist()
        self._flush_completions()
        if self.guard is None:
            return StepResult(step, loss, time.perf_counter() - t0, lr=self._lr)
        out = self.guard.finish(step, total)
        return StepResult(step, loss, time.perf_counter() - t0, lr=self._lr,
                          grad_norm=out.grad_norm, loss_scale=out.loss_scale, skipped=out.skipped)

    # ------------------------------------------------------------------
    def _batch(self, step: int):
        """This rank's micro-batches of `step` (the prefetched ones when staged), or None without data."""
        if self.data is None:
            return None
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == step:
            _, micro, stream = staged
            torch.cuda.current_stream(self.device).wait_stream(stream)
            return micro
        return self.data.micro_batches(step)

    def prefetch(self, step: int) -> None:
        """On CUDA: make `step`'s micro-batches now, pinned, and start their copies to the device on a side
        stream (the step that reads them waits for it). Nothing on the CPU, where there is no copy."""
        if self.data is None or self.device.type != "cuda":
            return
        from runtime.data import map_inputs

        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream, current = self._copy_stream, torch.cuda.current_stream(self.device)

        def send(t: torch.Tensor) -> torch.Tensor:
            with torch.cuda.stream(stream):
                out = t.pin_memory().to(self.device, non_blocking=True)
            out.record_stream(current)   # used on the compute stream: the allocator must know
            return out
        micro = [(map_inputs(inputs, send), send(targets)) for inputs, targets in self.data.micro_batches(step)]
        self._staged = (step, micro, stream)

    # ------------------------------------------------------------------
    def _record_async(self, step: int, idx: int, ins: Instr, h: Handle, start) -> None:
        """Record an asynchronous instruction from its issue (the Recorder's mark `start`) to its
        completion (comm track).

        The completion callback runs on the communication thread: it only takes a mark (on a GPU
        an event on the stream the callback runs with, which follows the collective); the event
        is built after the step."""
        if not self.recorder.enabled:
            return
        done, rec = self._completions, self.recorder
        h.on_complete(lambda: done.append((step, idx, start, rec.mark())))

    def _flush_completions(self) -> None:
        rec, instrs = self.recorder, self.program.instrs
        for step, idx, start, end in self._completions:
            rec.add_interval(step, idx, self._names[idx], instrs[idx].op, start, end, track=Track.COMM)
        self._completions.clear()

    # ---- the instructions: one handler each, found in HANDLERS by (op, kind) or (op, None) ----------
    def _exec(self, idx: int, ins: Instr, w: "_Walk") -> None:
        handler = HANDLERS.get((ins.op, ins.kind)) or HANDLERS.get((ins.op, None))
        if handler is None:
            raise RuntimeError(f"the executor cannot run {ins.op} {ins.kind!r} instructions")
        handler(self, idx, ins, w)

    def _issued(self, idx: int, ins: Instr, w: "_Walk", h: Handle, start) -> None:
        """An asynchronous instruction's handle, kept for its WAIT and recorded from `start`."""
        w.handles[ins.handle] = h
        self._record_async(w.step, idx, ins, h, start)

    def _run_forward(self, idx: int, ins: Instr, w: "_Walk") -> None:
        runner = self.stages[ins.stage]
        inputs = []
        received = iter(w.recv_act.pop((ins.stage, ins.micro), []))
        for b in runner.spec.inputs:
            if b.source == "data":
                inputs.append(pick_input(w.micro[ins.micro][0], b.data_index, b.data_key)
                              .to(self.device, non_blocking=True))
            else:
                inputs.append(next(received))
        targets = w.micro[ins.micro][1].to(self.device) if runner.spec.is_last else None
        share = self.program.num_micro_batches * self.ctx.size(MeshAxis.DATA)
        out = runner.evaluate(inputs, targets) if self._evaluating else runner.forward(ins.micro, inputs, targets)
        if not runner.spec.is_last:
            w.out_act[(ins.stage, ins.micro)] = out
        elif self._evaluating:   # (loss, correct, counted): the counts add up over the data ranks
            loss, correct, counted = out
            w.loss_buf[0] += loss.detach().to(w.loss_buf.dtype) / share
            w.loss_buf[1] += correct
            w.loss_buf[2] += counted
        else:   # on the device: the step reads its loss back once, at its end
            w.loss_buf += out.detach().to(w.loss_buf.dtype) / share
        if self.grads is not None:   # ZeRO-3 frees the stage's gathered parameters
            self.grads.release_params(ins.stage)

    def _run_backward(self, idx: int, ins: Instr, w: "_Walk") -> None:
        runner = self.stages[ins.stage]
        attached = self._attached.get(idx)
        if attached and self.grads is not None:
            self._arm_buckets(attached, w)
        grads = None if runner.spec.is_last else w.recv_grad.pop((ins.stage, ins.micro), None)
        if not runner.spec.is_last and grads is None:
            grads = [None] * len(runner.spec.outputs)
        elif grads is not None:
            it = iter(grads)
            grads = [next(it) if b.requires_grad else None for b in runner.spec.outputs]
        w.out_grad[(ins.stage, ins.micro)] = runner.backward(ins.micro, grads)
        if self.grads is not None:   # ZeRO-3 frees the stage's gathered parameters
            self.grads.release_params(ins.stage)

    def _arm_buckets(self, attached: list[int], w: "_Walk") -> None:
        """Let the backward issue the gradient collectives at `attached` (instruction indices) from its
        bucket hooks, each handle recorded as the instruction's own."""
        instrs, start = self.program.instrs, self.recorder.mark

        def on_launch_for(j):
            def cb(h):
                w.handles[instrs[j].handle] = h
                self._record_async(w.step, j, instrs[j], h, start())
            return cb
        self.grads.arm([instrs[j].bucket for j in attached], {instrs[j].bucket: on_launch_for(j) for j in attached})

    def _send(self, idx: int, ins: Instr, w: "_Walk") -> None:
        # "act s m": stage s's outputs, to stage s + 1; "grad s m": the gradients of those
        # outputs, computed by the backward of stage s + 1, back to stage s.
        if ins.kind == Kind.ACT:
            runner = self.stages[ins.stage]
            tensors = [_as(t.detach(), b.dtype) for t, b in zip(w.out_act.pop((ins.stage, ins.micro)), runner.spec.outputs)]
        else:
            runner = self.stages[ins.stage + 1]
            tensors = [_as(g, b.dtype) if g is not None else
                       torch.zeros(b.shape, dtype=getattr(torch, b.dtype), device=self.device)
                       for g, b in zip(w.out_grad.pop((ins.stage + 1, ins.micro)), runner.spec.inputs)
                       if b.source == "recv" and b.requires_grad]
        # Tensors travel in the dtype the spec promises (under autocast an activation may be
        # bf16 where the spec says float32: it is sent upcast, losslessly).
        start = self.recorder.mark()
        h = _Multi([self.ctx.comm.isend(t, ins.peer, p2p_tag(ins.kind, ins.stage, ins.micro, k))
                    for k, t in enumerate(tensors)])
        h._keep = tensors  # type: ignore[attr-defined]  # the buffers live until the send completes
        self._issued(idx, ins, w, h, start)

    def _recv(self, idx: int, ins: Instr, w: "_Walk") -> None:
        if ins.kind == Kind.ACT:
            consumer = ins.stage + 1
            specs = [b for b in self.stages[consumer].spec.inputs if b.source == "recv"]
        else:
            consumer = ins.stage
            specs = [b for b in self.stages[consumer].spec.outputs if b.requires_grad]
        bufs = [torch.empty(b.shape, dtype=getattr(torch, b.dtype), device=self.device) for b in specs]
        start = self.recorder.mark()
        h = _Multi([self.ctx.comm.irecv(t, ins.peer, p2p_tag(ins.kind, ins.stage, ins.micro, k))
                    for k, t in enumerate(bufs)])
        (w.recv_act if ins.kind == Kind.ACT else w.recv_grad)[(consumer, ins.micro)] = bufs
        self._issued(idx, ins, w, h, start)

    def _wait(self, idx: int, ins: Instr, w: "_Walk") -> None:
        h = w.handles.pop(ins.handle, None)
        if h is None:
            raise RuntimeError(f"WAIT on handle h{ins.handle}, which no earlier instruction created")
        h.wait()

    def _reduce_grads(self, idx: int, ins: Instr, w: "_Walk") -> None:
        h, early = self.grads.launch(ins.bucket)
        if not early:   # an armed bucket was issued by its backward, which recorded it
            self._issued(idx, ins, w, h, self.recorder.mark())

    def _gather_params(self, idx: int, ins: Instr, w: "_Walk") -> None:
        start = self.recorder.mark()
        self._issued(idx, ins, w, self.grads.gather_params(ins.bucket), start)

    def _reduce_tied(self, idx: int, ins: Instr, w: "_Walk") -> None:
        start = self.recorder.mark()
        self._issued(idx, ins, w, self.ties.launch(ins.bucket), start)

    def _reduce_loss(self, idx: int, ins: Instr, w: "_Walk") -> None:
        start = self.recorder.mark()
        self._issued(idx, ins, w, self.ctx.group(ins.axis).all_reduce(w.loss_buf, async_op=True), start)

    def _broadcast_loss(self, idx: int, ins: Instr, w: "_Walk") -> None:
        start = self.recorder.mark()
        self._issued(idx, ins, w, self.ctx.group(ins.axis).broadcast(w.loss_buf, ins.peer, async_op=True), start)

    def _reduce_stats(self, idx: int, ins: Instr, w: "_Walk") -> None:
        start = self.recorder.mark()
        self._issued(idx, ins, w, self.stats.launch(ins.stage), start)

    def _optimizer_step(self, idx: int, ins: Instr, w: "_Walk") -> None:
        if self.guard is not None:   # unscale, record (--verify), norm; skip on overflow or clip
            skip = self.guard.prepare(w.step, self.on_step)
        else:
            skip = False
            if self.on_step is not None:
                self.on_step()
        if self.optimizer is not None:
            self._lr = current_lr(self.optimizer)   # the lr this step uses (a skipped step's too)
            if not skip:
                self.optimizer.step()
            # the schedule follows the step count, skipped steps included (PyTorch's AMP recipe)
            if self.scheduler is not None:
                self.scheduler.step()

    def _zero_grad(self, idx: int, ins: Instr, w: "_Walk") -> None:
        if self.grads is not None:   # gradients are views of the buckets: zeroed in place
            self.grads.zero_grad()
            return
        # set to None, as the reference's loop: backward then writes the first gradient, no add
        if self._held is None:   # walking the stage modules costs the host more than the step's kernels
            self._held = [p for runner in self.stages.values() for p in runner.module.parameters()]
        for p in self._held:
            p.grad = None


# (op, kind) -> the Executor's handler; (op, None) serves every kind of that op
HANDLERS: dict[tuple[Op, Kind | None], Callable[[Executor, int, Instr, _Walk], None]] = {
    (Op.F, None): Executor._run_forward,
    (Op.B, None): Executor._run_backward,
    (Op.SEND, None): Executor._send,
    (Op.RECV, None): Executor._recv,
    (Op.WAIT, None): Executor._wait,
    (Op.ALLREDUCE, Kind.GRADS): Executor._reduce_grads,
    (Op.REDUCESCATTER, Kind.GRADS): Executor._reduce_grads,
    (Op.ALLGATHER, Kind.PARAMS): Executor._gather_params,
    (Op.ALLREDUCE, Kind.TIED): Executor._reduce_tied,
    (Op.ALLREDUCE, Kind.LOSS): Executor._reduce_loss,
    (Op.BROADCAST, Kind.LOSS): Executor._broadcast_loss,
    (Op.ALLREDUCE, Kind.STATS): Executor._reduce_stats,
    (Op.STEP, None): Executor._optimizer_step,
    (Op.ZERO_GRAD, None): Executor._zero_grad,
}
