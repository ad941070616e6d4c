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
(docs/STRATEGIES.md, "Bidirectional pipelines"). `simulate` computes the general case (any per-stage times,
point-to-point transfers) by list scheduling the per-device order.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    Micro-batches are numbered 2t (replica A) and 2t+1 (replica B) for pair t.
    """
    p = pipeline
    order: list[list[Task]] = [[] for _ in range(p)]
    for t in range(replicas_per_direction):
        for replica, micro in (("A", 2 * t), ("B", 2 * t + 1)):
            for dev in range(p):
                stage = dev if replica == "A" else p - 1 - dev
                order[dev].append(Task(replica, "F", stage, micro))
                order[dev].append(Task(replica, "B", stage, micro))
    return order


def simulate(forward: list[float], backward: list[float], replicas_per_direction: int,
             p2p: float = 0.0) -> tuple[float, list[float]]:
    """(step seconds, busy seconds per device) of the bi-directional schedule.

    forward[s], backward[s]: seconds of stage s for one micro-batch (both
    replicas have the same stages). p2p: seconds to move one activation or
    gradient between neighbouring devices. A task starts when its device is
    free and its input has arrived: a forward needs the previous stage's
    forward of the same micro-batch; a backward needs the next stage's
    backward (the last stage's backward needs its own forward).
    """
    p = len(forward)
    if p < 1 or len(backward) != p:
        raise ValueError(f"forward and backward need one time per stage; got {len(forward)} and {len(backward)}")
    # One pass in an order that respects both the data dependencies and each
    # device's task order (pair by pair: A's forwards up the stages, A's
    # backwards down, then the same for B), so every task's start time is final
    # when it is reached: exactly the list schedule of device_order, in O(tasks).
    free = [0.0] * p
    busy = [0.0] * p
    for t in range(replicas_per_direction):
        for replica in ("A", "B"):
            arrive = 0.0
            for stage in range(p):  # forwards
                dev = stage if replica == "A" else p - 1 - stage
                start = max(free[dev], arrive)
                free[dev] = start + forward[stage]
                busy[dev] += forward[stage]
                arrive = free[dev] + (p2p if stage < p - 1 else 0.0)
            arrive = free[p - 1 if replica == "A" else 0]
            for stage in range(p - 1, -1, -1):  # backwards
                dev = stage if replica == "A" else p - 1 - stage
                start = max(free[dev], arrive)
                free[dev] = start + backward[stage]
                busy[dev] += backward[stage]
                arrive = free[dev] + p2p
    return max(free), busy


def uniform_step_time(pipeline: int, replicas_per_direction: int, f: float, b: float) -> float:
    """T(eta) = eta*p*(f+b) - (eta-1)*(p-1)*f, eta = 2T: GEMS's closed form for uniform stages."""
    eta = 2 * replicas_per_direction
    return eta * pipeline * (f + b) - (eta - 1) * (pipeline - 1) * f


def pair_of(device: int, pipeline: int) -> int:
    """The device that holds the same two stages (in the other direction)."""
    return pipeline - 1 - device
