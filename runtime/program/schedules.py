"""Pipeline schedules as plain data: per pipeline position, the ordered F/B actions.

The one definition of the schedules: codegen lowers these lists into Programs
(codegen/lower.py adds the communication around them), the cost model reads its
activation peaks (cost_models/memory.py) and its bidirectional step timing
(planner/strategies/bidirectional/costs.py) from them, and calibration runs the 1F1B one.

A schedule is `dict[pipe_rank, list[Instr]]` holding only "F s m" and
"B s m" instructions (torch.distributed.pipelining's "actions"). Stage k runs
on pipeline position k % p, so with v chunks per position, position i holds
stages i, i + p, ..., i + (v - 1) p.

  gpipe:       all forwards, then all backwards (every micro-batch's activations live at once)
  1f1b:        p - i - 1 warm-up forwards on position i, then one forward / one backward
  interleaved: Megatron-LM's interleaved 1F1B over v chunks per position; micro-batches
               advance in groups of p, so m must be a multiple of p
  bidirectional: GEMS (MAST T=1, MASTER T>1): two replicas of the p stages run in opposite
               directions over the same positions; position i holds stage i (replica A,
               even micro-batches) and stage p-1-i (replica B, odd micro-batches). Stage
               numbers stay the model's, the micro-batch parity says the direction.
"""

from __future__ import annotations

from runtime.program.instr_set import Op
from runtime.program import Instr
from runtime.vocab import Schedule


class ScheduleError(ValueError):
    """A schedule that cannot be built for these sizes; the message says which to change."""


def _check(p: int, m: int, v: int = 1) -> None:
    for name, x in (("pipeline", p), ("micro-batches", m), ("virtual stages", v)):
        if not isinstance(x, int) or x < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {x!r}")


def warmup(schedule: str, position: int, p: int, m: int, v: int = 1) -> int:
    """Forward actions position `position` runs before its first backward (of m * v in all).

    gpipe: all of them; 1f1b: p - position - 1; interleaved: Megatron-LM's
    2 (p - position - 1) + (v - 1) p chunk forwards. The builders below use it, so it is
    the schedule's own count, not an estimate of it.
    """
    if schedule == Schedule.GPIPE:
        return m
    if schedule == Schedule.ONE_F_ONE_B:
        return min(p - 1 - position, m)
    if schedule == Schedule.INTERLEAVED:
        return min((p - position - 1) * 2 + (v - 1) * p, m * v)
    raise ScheduleError(f"unknown schedule {schedule!r}; known: {', '.join(Schedule)}")


def forwards_in_flight(schedule: str, position: int, p: int, m: int, v: int = 1) -> int:
    """The peak number of forward actions whose backward has not run yet on `position`.

    After the warm-up every forward is followed by a backward, so the peak is one more than
    the warm-up (all m * v when the warm-up already runs every forward)."""
    return min(warmup(schedule, position, p, m, v) + 1, m * v)


def gpipe(p: int, m: int) -> dict[int, list[Instr]]:
    _check(p, m)
    return {i: [Instr(Op.F, i, k) for k in range(m)] + [Instr(Op.B, i, k) for k in range(m)] for i in range(p)}


def one_f_one_b(p: int, m: int) -> dict[int, list[Instr]]:
    _check(p, m)
    out = {}
    for i in range(p):
        warm = warmup(Schedule.ONE_F_ONE_B, i, p, m)
        acts = [Instr(Op.F, i, k) for k in range(warm)]
        for k in range(m - warm):
            acts += [Instr(Op.F, i, warm + k), Instr(Op.B, i, k)]
        acts += [Instr(Op.B, i, k) for k in range(m - warm, m)]
        out[i] = acts
    return out


def interleaved(p: int, m: int, v: int) -> dict[int, list[Instr]]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2)."""
    _check(p, m, v)
    if v < 2:
        raise ScheduleError("the interleaved schedule needs at least 2 chunks per pipeline position")
    if m % p:
        raise ScheduleError(f"the interleaved schedule runs micro-batches in groups of the pipeline size: "
                            f"{m} micro-batches is not a multiple of pipeline {p}; pick a batch giving a multiple "
                            f"of {p} micro-batches, or use 1f1b")
    total = m * v
    out = {}
    for i in range(p):
        def fwd(k: int) -> Instr:
            chunk = (k // p) % v
            return Instr(Op.F, chunk * p + i, (k // (p * v)) * p + k % p)

        def bwd(k: int) -> Instr:
            chunk = v - 1 - (k // p) % v
            return Instr(Op.B, chunk * p + i, (k // (p * v)) * p + k % p)

        warm = warmup(Schedule.INTERLEAVED, i, p, m, v)
        acts = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            acts += [fwd(warm + k), bwd(k)]
        acts += [bwd(k) for k in range(total - warm, total)]
        out[i] = acts
    return out


def bidirectional_position(stage: int, micro: int, p: int) -> int:
    """Pipeline position that runs `stage` for `micro` under the bidirectional schedule:
    replica A (even micro-batches) runs stage s on position s, replica B (odd) on p-1-s.
    The map is its own inverse: it also gives the stage a position runs for `micro`."""
    return stage if micro % 2 == 0 else p - 1 - stage


def bidirectional(p: int, replicas_per_direction: int) -> dict[int, list[Instr]]:
    """GEMS's per-position order: for each pair t, replica A's micro-batch 2t (forward, then
    backward, of this position's A stage), then replica B's micro-batch 2t+1 (its B stage).

    Deadlock-free: every forward waits only on a forward earlier in the same direction,
    every backward on a backward later in the same direction, and each position finishes
    A's micro-batch before it starts B's, so the dependency graph follows the order.
    """
    _check(p, 2 * replicas_per_direction)
    if p < 2:
        raise ScheduleError("the bidirectional schedule needs pipeline >= 2")
    out: dict[int, list[Instr]] = {i: [] for i in range(p)}
    for t in range(replicas_per_direction):
        for micro in (2 * t, 2 * t + 1):
            for i in range(p):
                stage = bidirectional_position(i, micro, p)
                out[i] += [Instr(Op.F, stage, micro), Instr(Op.B, stage, micro)]
    return out


def build_schedule(name: str, p: int, m: int, v: int = 1) -> dict[int, list[Instr]]:
    """The compute actions of every pipeline position for schedule `name`."""
    if name == Schedule.GPIPE:
        return gpipe(p, m)
    if name == Schedule.ONE_F_ONE_B:
        return one_f_one_b(p, m)
    if name == Schedule.INTERLEAVED:
        return interleaved(p, m, v)
    raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(Schedule)}")


def format_schedule(sched: dict[int, list[Instr]]) -> str:
    """One line per position, actions as "F0.1" (forward, stage 0, micro-batch 1)."""
    return "\n".join(f"p{i}: " + " ".join(f"{a.op}{a.stage}.{a.micro}" for a in acts)
                     for i, acts in sorted(sched.items()))
