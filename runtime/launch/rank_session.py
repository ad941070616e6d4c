"""A rank's state as runtime/rank_main.py builds it: `Prepared` (what it sets up alone, before it talks to
any other rank) and `RankSession` (connected, ready to run steps)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from runtime.checkpoint.restore import Restore
from runtime.checkpoint.run_ids import CheckpointClaim
from runtime.data import DataSource
from runtime.execute.evaluation import EvalSpec
from runtime.executor import Executor
from runtime.launch.placement import Placement
from runtime.execute.grads import GradSync
from runtime.program import Program
from runtime.spec import StageSpec, TrainSpec
from runtime.verify.step_record import StepRecorder
from runtime.launch.watchdog import Watchdog


@dataclass
class Prepared:
    """Everything a rank sets up alone, before it talks to any other rank."""

    rank: int
    program: Program
    spec: TrainSpec
    args: argparse.Namespace
    backend: str
    device: torch.device
    specs: dict[int, StageSpec]
    modules: dict[int, torch.nn.Module]
    data: DataSource | None
    fail_at: tuple[int, int] | None
    restore: Restore | None = None
    signature: str = ""        # model_signature the build was made for
    evaluation: EvalSpec | None = None   # held-out evaluation (runtime/execute/evaluation.py)
    eval_data: DataSource | None = None
    where: Placement = Placement()        # this process's node and place on it (runtime/launch/placement.py)
    build_id: str = ""                    # runtime/join.build_identity of the build (compared at the rendezvous)
    devices_per_node: int | None = None   # the plan's (None: a build that does not record it)


@dataclass
class RankSession:
    """A connected rank, ready to run steps (`executor.run_step(step)`)."""

    prepared: Prepared
    comm: object
    executor: Executor
    grads: GradSync | None
    watchdog: Watchdog | None = None
    recorder: StepRecorder | None = None
    checkpoint_claim: CheckpointClaim | None = None   # rank 0 with --checkpoint-dir: its lock and run id
    results: list = dataclasses.field(default_factory=list)   # every step's StepResult, in order
    out_ranks: list[int] | None = None   # the ranks whose --out is rank 0's (None: not probed: all)
    compiled: list = dataclasses.field(default_factory=list)  # compiled stages or loss: graphs made after each step

    def close(self) -> None:
        if self.checkpoint_claim is not None:
            self.checkpoint_claim.release()
        if self.watchdog is not None:
            self.watchdog.close()
        self.comm.shutdown()
