"""Bi-directional pipelines (GEMS MAST and MASTER): per-device order and step time.

Two model replicas share p devices in opposite directions: device r holds
stage r of replica A and stage p-1-r of replica B. MASTER repeats the pair T
times (replication factor 2T); each replica-direction pass handles one
micro-batch. Every device runs, for each pair: A's forward and backward of its
stage, then B's forward and backward. Because the last device of A is the
first device of B, B's forwards start while A's backwards still drain, which
fills the bubble.

For uniform stages (forward f, backward b) and no communication the step
takes T(eta) = eta * p * (f + b) - (eta - 1) * (p - 1) * f with eta = 2T
(docs/STRATEGIES.md, "Bidirectional pipelines"). `step_time` computes the general case (any per-stage times,
point-to-point transfers) by list scheduling the per-device order of the bidirectional
schedule (runtime/program/schedules.py), the same action lists codegen lowers.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.program.schedules import bidirectional


@dataclass(frozen=True)
class Task:
    """One pass of one stage for one micro-batch on one device.

    replica: "A" or "B"; pass_: "F" or "B" (forward/backward); stage: the
    model stage (0 = first layers); micro: which of the 2T micro-batches.
    """

    replica: str
    pass_: str
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.pass_}{self.replica} s{self.stage} m{self.micro}"


def device_order(pipeline: int, replicas_per_direction: int) -> list[list[Task]]:
    """The GEMS order of tasks on each device: for each pair t, A's F and B, then B's F and B.

    Micro-batches are numbered 2t (replica A) and 2t+1 (replica B) for pair t. It is the
    bidirectional schedule of runtime/program/schedules.py, the one codegen lowers, with the replica
    of each action named.
    """
    sched = bidirectional(pipeline, replicas_per_direction)
    return [[Task("A" if a.micro % 2 == 0 else "B", a.op, a.stage, a.micro) for a in sched[dev]]
            for dev in range(pipeline)]


def step_time(forward: list[float], backward: list[float], replicas_per_direction: int,
              p2p: float = 0.0) -> tuple[float, list[float]]:
    """(step seconds, busy seconds per device) of the bi-directional schedule.

    forward[s], backward[s]: seconds of stage s for one micro-batch (both
    replicas have the same stages). p2p: seconds to move one activation or
    gradient between neighbouring devices. The list schedule of
    :func:`device_order`: a task starts when its device has finished the task before it
    and its input has arrived: a forward needs the previous stage's forward of the same
    micro-batch; a backward needs the next stage's backward (the last stage's backward
    needs its own forward, on the same device).
    """
    p = len(forward)
    if p < 1 or len(backward) != p:
        raise ValueError(f"forward and backward need one time per stage; got {len(forward)} and {len(backward)}")
    order = device_order(p, replicas_per_direction)
    done: dict[tuple[str, int, int], float] = {}   # (pass, stage, micro) -> end time
    free = [0.0] * p
    busy = [0.0] * p
    nxt = [0] * p
    while any(nxt[dev] < len(order[dev]) for dev in range(p)):
        for dev in range(p):
            while nxt[dev] < len(order[dev]):
                task = order[dev][nxt[dev]]
                arrive = _arrival(task, done, p, p2p)
                if arrive is None:
                    break
                seconds = forward[task.stage] if task.pass_ == "F" else backward[task.stage]
                start = max(free[dev], arrive)
                free[dev] = start + seconds
                busy[dev] += seconds
                done[(task.pass_, task.stage, task.micro)] = free[dev]
                nxt[dev] += 1
    return max(free), busy


def _arrival(task: Task, done: dict[tuple[str, int, int], float], p: int, p2p: float) -> float | None:
    """When `task`'s input is on its device (s), or None while the task producing it has not run."""
    if task.pass_ == "F":
        if task.stage == 0:
            return 0.0
        before = done.get(("F", task.stage - 1, task.micro))
        return None if before is None else before + p2p
    if task.stage == p - 1:
        return done.get(("F", task.stage, task.micro))
    after = done.get(("B", task.stage + 1, task.micro))
    return None if after is None else after + p2p


def uniform_step_time(pipeline: int, replicas_per_direction: int, f: float, b: float) -> float:
    """T(eta) = eta*p*(f+b) - (eta-1)*(p-1)*f, eta = 2T: GEMS's closed form for uniform stages."""
    eta = 2 * replicas_per_direction
    return eta * pipeline * (f + b) - (eta - 1) * (pipeline - 1) * f


def pair_of(device: int, pipeline: int) -> int:
    """The device that holds the same two stages (in the other direction)."""
    return pipeline - 1 - device
