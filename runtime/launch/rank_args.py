"""A rank's command line and what its launcher says about it: the options every rank script takes
(`parse_args`, shared by meshplan's rank scripts and the PyTorch-stack target's script), the rank and
world size the launcher's environment gives, and the checks that refuse a process started as the
wrong rank or in a world of the wrong size (LaunchError), before it talks to any other rank."""

from __future__ import annotations

import argparse
import os

from runtime.launch.faults import FAULTS
from runtime.program import Program
from runtime.program.trace import TRACE_WINDOW_STEPS
from runtime.verify.sabotage import SABOTAGE
from runtime.vocab import Backend


class LaunchError(ValueError):
    """The processes were started in a way that does not match the build."""


_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def env_rank() -> int | None:
    for k in _RANK_VARS:
        if os.environ.get(k, "").strip().isdigit():
            return int(os.environ[k])
    return None


def env_world_size() -> tuple[int, str] | None:
    for k in _SIZE_VARS:
        if os.environ.get(k, "").strip().isdigit():
            return int(os.environ[k]), k
    return None


def parse_args(argv, default_out: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Run one rank of a meshplan build.")
    ap.add_argument("--backend", choices=tuple(Backend), default=None,
                    help="communication backend (default: nccl with CUDA, else gloo)")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps to run")
    ap.add_argument("--out", default=default_out, help="where metrics and traces go (default: the build dir)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds any rendezvous or communication may take")
    ap.add_argument("--heartbeat-timeout", type=float, default=30.0,
                    help="seconds without a heartbeat after which a rank is named as not responding and the run "
                         "stops (independent of --timeout; default 30)")
    ap.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    ap.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", "29500")))
    ap.add_argument("--save-params", action="store_true", help="save the final parameters of this rank's stages")
    ap.add_argument("--save-steps", action="store_true",
                    help="record every step's parameters, gradients and buffers (for meshplan run --verify)")
    ap.add_argument("--sabotage", choices=SABOTAGE, default=None,
                    help="(testing) break the run on purpose, to show that --verify notices: drop-bucket (bucket 0's "
                         "gradients are not reduced), skip-tied-sum (tied copies keep their own gradients), "
                         "drop-halo-grad (spatial tiles ignore their neighbours' halo gradients)")
    trace = ap.add_mutually_exclusive_group()
    trace.add_argument("--trace", action="store_true",
                       help=f"record the Timeline of every step (default: of the first {TRACE_WINDOW_STEPS} steps "
                            "of the run, so that a long run's trace stays small)")
    trace.add_argument("--no-trace", action="store_true", help="do not record or write the Timeline")
    ap.add_argument("--probe-comm", action="store_true",
                    help="before the first step, time an all-reduce of 1 MiB over all ranks and record it in "
                         "run/rank_XXXX.json, so that `meshplan compare` can tell whether this run's machine "
                         "moved data as fast as when it was calibrated")
    ap.add_argument("--track-memory", action="store_true",
                    help="measure the peak memory of the second step (the first with at least 3 steps: live "
                         "tensor bytes on CPU, the CUDA allocator's peak on GPU)")
    ap.add_argument("--tensorboard", default=None, metavar="DIR",
                    help="rank 0 also writes metrics.jsonl's scalars as TensorBoard event files under DIR "
                         "(needs pip install 'meshplan[tensorboard]')")
    ap.add_argument("--no-progress", action="store_true",
                    help="rank 0 draws no progress display (meshplan run draws its own)")
    ap.add_argument("--fail-at", default=None, metavar="RANK:STEP:INSTR",
                    help="(testing) make RANK fail at this step and instruction index")
    ap.add_argument("--fault", choices=FAULTS, default="raise",
                    help="(testing) how --fail-at fails: raise, sigkill, hang, or (in the checkpoint saved after STEP) "
                         "sigkill-in-save or disk-full-in-save")
    ap.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints under this directory")
    ap.add_argument("--save-every", type=int, default=0,
                    help="save a checkpoint every N steps (0: only after the last step); needs --checkpoint-dir")
    ap.add_argument("--resume", default=None, metavar="CHECKPOINT",
                    help="continue from a checkpoint directory, or the newest complete one under a --checkpoint-dir")
    ap.add_argument("--resume-from-other-run", action="store_true",
                    help="allow --resume from a checkpoint of another run than the one whose checkpoints "
                         "--checkpoint-dir holds (that run then continues from this state; see "
                         "runtime/checkpoint/run_ids.py)")
    ap.add_argument("--eval-every", type=int, default=None, metavar="N",
                    help="evaluate on held-out batches after every N-th step (default: as the build says)")
    ap.add_argument("--eval-batches", type=int, default=None, metavar="K",
                    help="held-out global batches per evaluation (default: as the build says, else 1)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise LaunchError(f"--steps must be at least 1, got {args.steps}")
    if not args.timeout > 0 or not args.heartbeat_timeout > 0:
        raise LaunchError(f"--timeout and --heartbeat-timeout must be positive seconds, got {args.timeout} and "
                          f"{args.heartbeat_timeout}")
    if args.save_every < 0 or (args.save_every and not args.checkpoint_dir):
        raise LaunchError("--save-every needs --checkpoint-dir and a count of at least 1")
    if args.resume_from_other_run and not (args.resume and args.checkpoint_dir):
        raise LaunchError("--resume-from-other-run applies to a run that resumes (--resume) and saves "
                          "(--checkpoint-dir); give both, or leave it out")
    return args


def check_launch(rank: int, prog: Program, args) -> None:
    if prog.rank != rank:
        raise LaunchError(f"this script is rank {rank} but holds the Program of rank {prog.rank}")
    er = env_rank()
    if er is not None and er != rank and args.backend != Backend.MPI:
        raise LaunchError(f"this is the script of rank {rank}, but the launcher says this process is rank {er}; "
                          "start the build through run_rank.py or its launch scripts")
    ws = env_world_size()
    if ws is not None and ws[0] != prog.world_size:
        raise LaunchError(f"the plan needs {prog.world_size} processes (mesh "
                          + " x ".join(f"{a} {s}" for a, s in prog.mesh)
                          + f"), but {ws[0]} were started ({ws[1]}={ws[0]}); start exactly {prog.world_size}")


def parse_fail_at(text: str | None, rank: int) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        r, s, i = (int(x) for x in text.split(":"))
    except ValueError:
        raise LaunchError(f"--fail-at wants RANK:STEP:INSTR, got {text!r}") from None
    return (s, i) if r == rank else None


__all__ = ["LaunchError", "check_launch", "env_rank", "env_world_size", "parse_args", "parse_fail_at"]
