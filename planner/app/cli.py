"""The `meshplan` command line. One verb per step; each has --help with examples.

    meshplan capture examples/models/gpt.py:build --arg preset=1t --batch 1
    meshplan optimize examples/models/gpt.py:build --arg preset=gpt3-175b --cluster dgx-a100-80gb --nodes 16 --batch 1536
    meshplan cluster dgx-a100-80gb --nodes 2 -o cluster.yaml

User errors (bad references, files, sizes) print one line naming the problem
and exit with status 2; they never end in a traceback.

This module defines each verb's arguments; planner/app/verbs.py does what the verb says.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

# planner/__init__ already imports capture, the search and torch before this module runs.
from codegen.dataset_flags import add_dataset_flags
from codegen.train_flags import MAX_STEPS, add_flags
from cost_models.overlap import OverlapPreset
from planner.app import verbs
from planner.app.cli_args import MAX_BATCH, MAX_WORLD, add_strategy_flags, count, nonnegative_number, positive_number
from runtime.program.trace import TRACE_WINDOW_STEPS
from runtime.vocab import Backend, DType, RecomputeMode, Target

# Bounds of the numeric options (argparse refuses anything outside in one line).
BATCH = count(1, MAX_BATCH, " samples")
DEGREE = count(1, MAX_WORLD, " devices")
STEPS = count(1, MAX_STEPS)
MAX_RANKS = 1024  # calibration processes on one machine
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshplan", description="Parallelization-strategy compiler for DL training.")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")
    # in the order --help lists the verbs
    for add in (_add_capture, _add_optimize, _add_show, _add_cluster, _add_codegen, _add_run, _add_checkpoint,
                _add_calibrate, _add_compare):
        add(sub)
    return ap


_EPILOG_CAPTURE = """examples:
  meshplan capture examples/models/gpt.py:build --arg preset=1t --batch 1
  meshplan capture examples/models/resnet.py:build --arg depth=1001 -o resnet.json
The model is built under torch.device("meta") (no memory) and its example
inputs come from example_inputs() in the same module as the factory."""


def _add_capture(sub) -> None:
    p = sub.add_parser("capture", help="capture a model on meta tensors and print its graph summary",
                       epilog=_EPILOG_CAPTURE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL_REF", help="factory reference, e.g. examples/models/gpt.py:build")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory and example_inputs (repeatable)")
    p.add_argument("--batch", type=BATCH, default=1, help="samples in the example batch (default 1)")
    p.add_argument("--max-layers", type=count(0), default=12, help="layers listed in the summary (default 12)")
    p.add_argument("-o", "--output", help="also write the ModelGraph as JSON here")
    _add_force(p)
    p.set_defaults(func=verbs.cmd_capture)


_EPILOG_OPTIMIZE = """examples:
  meshplan optimize examples/models/gpt.py:build --arg preset=gpt3-175b --cluster dgx-a100-80gb --nodes 16 --batch 1536
  meshplan optimize examples/models/gpt.py:build --arg preset=1t --cluster dgx-a100-80gb --nodes 384 \\
      --batch 3072 --constraint tensor=8 --constraint max_memory_fraction=0.9 -o plan_1t.json
  meshplan optimize examples/models/gpt.py:build --arg preset=tiny --cluster dgx-a100-80gb --batch 16 --target torch
Prints the plan, the runners-up with the reason each lost, and writes the plan as JSON."""


def _add_optimize(sub) -> None:
    p = sub.add_parser("optimize", help="search the best plan for a model on a cluster and write plan.json",
                       epilog=_EPILOG_OPTIMIZE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL_REF", help="factory reference, e.g. examples/models/gpt.py:build")
    p.add_argument("--cluster", required=True, metavar="PRESET_OR_FILE", help="cluster preset or file")
    p.add_argument("--nodes", type=DEGREE, help="nodes of a preset cluster")
    p.add_argument("--devices", type=DEGREE, help="devices of a preset cluster (for 'local', processes)")
    p.add_argument("--batch", type=BATCH, required=True, help="global batch size (samples per step)")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory and example_inputs (repeatable)")
    p.add_argument("--objective", choices=["time", "energy"], default="time")
    p.add_argument("--constraint", action="append", default=[], metavar="KEY=VALUE",
                   help="fixed knob or limit, e.g. tensor=8, max_memory_fraction=0.9 (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--what-if", action="store_true",
                   help="also search what the cost model prices but meshplan's runtime does not run yet (the plan "
                        "is for comparison; codegen refuses it)")
    p.add_argument("--target", default=Target.MESHPLAN.value, choices=list(map(str, Target)),
                   help="what will run the plan: meshplan's own runtime (default), or torch (PyTorch's DeviceMesh, "
                        "DTensor, FSDP2 and pipelining, through planner.parallelize or codegen --target torch); the "
                        "search picks only strategies the target runs")
    p.add_argument("--stack", default=None, choices=list(map(str, OverlapPreset)),
                   help="the training stack whose communication overlap and selective recomputation the cost model "
                        "assumes (cost_models/overlap.py; default: the target's, meshplan for meshplan, torchtitan's "
                        "overlap for torch)")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default plan.json)")
    _add_force(p)
    p.set_defaults(func=verbs.cmd_optimize)


_EPILOG_SHOW = """examples:
  meshplan show plan.json                 # plan_mesh.png, plan_memory.png, ... and plan_report.html
  meshplan show plan.json -o pictures/gpt # pictures/gpt_mesh.png ... pictures/gpt_report.html
PNG and SVG of each picture, plus one self-contained HTML report."""


def _add_show(sub) -> None:
    p = sub.add_parser("show", help="print a plan and draw it (mesh, memory, time, alternatives, schedule)",
                       epilog=_EPILOG_SHOW, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", metavar="PLAN_JSON")
    p.add_argument("-o", "--output", help="file stem for the pictures (default: next to the plan, plan_*.png)")
    _add_force(p)
    p.set_defaults(func=verbs.cmd_show)


_EPILOG_CLUSTER = """examples:
  meshplan cluster dgx-a100-80gb --nodes 4
  meshplan cluster local --devices 2 -o local.yaml
  meshplan cluster local --remeasure       # measure this machine again (a reading taken while it was busy)
  meshplan cluster my_cluster.yaml"""


def _add_cluster(sub) -> None:
    p = sub.add_parser("cluster", help="show a preset or a cluster file, optionally save it",
                       epilog=_EPILOG_CLUSTER, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", metavar="PRESET_OR_FILE")
    p.add_argument("--nodes", type=DEGREE, help="number of nodes (presets only)")
    p.add_argument("--devices", type=DEGREE, help="devices (presets only; for 'local', processes)")
    p.add_argument("-o", "--output", help="write the cluster as YAML or JSON (by suffix)")
    p.add_argument("--remeasure", action="store_true",
                   help="'local' only: measure this machine now, whatever its cache holds (after a busy reading)")
    _add_force(p)
    p.set_defaults(func=verbs.cmd_cluster)


_EPILOG_CODEGEN = """examples:
  meshplan codegen examples/models/gpt.py:build --arg preset=tiny --batch 8 \\
      --data 2 --tensor 2 --pipeline 2 --micro-batch 2 --schedule 1f1b --dtype fp32 -o build
  meshplan codegen examples/models/gpt.py:build --arg preset=tiny --plan plan.json -o build
  meshplan codegen examples/models/gpt.py:build --batch 8 --data 2 --tensor 2 --target torch -o build
Writes plan.json, one rank_XXXX.py per rank and launch scripts (torchrun, mpirun, srun); with
--target torch one train_torch.py for every rank (PyTorch's DeviceMesh, DTensor, FSDP2) and the
torchrun and srun scripts."""


def _add_codegen(sub) -> None:
    p = sub.add_parser("codegen", help="generate per-rank programs, rank scripts and launchers for a plan",
                       epilog=_EPILOG_CODEGEN, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL_REF", help="factory reference, e.g. examples/models/gpt.py:build")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="factory keyword (repeatable)")
    p.add_argument("--plan", help="a plan file (from meshplan optimize); otherwise give the configuration below")
    p.add_argument("--batch", type=BATCH, help="global batch size (samples per optimizer step)")
    add_strategy_flags(p)
    p.add_argument("--micro-batch", type=BATCH, default=1, help="samples per micro-batch per data rank")
    p.add_argument("--recompute", default=RecomputeMode.NONE.value, choices=list(map(str, RecomputeMode)))
    p.add_argument("--dtype", default=DType.FP32.value, choices=list(map(str, DType)))
    p.add_argument("--cluster", help="cluster preset or file the plan is priced on (default: local)")
    p.add_argument("--nodes", type=DEGREE, help="nodes of a preset cluster")
    _add_batch_source_flags(p)
    _add_training_flags(p)
    _add_loss_scale_flags(p)
    p.add_argument("--target", default=Target.MESHPLAN.value, choices=list(map(str, Target)),
                   help="what runs the plan: meshplan's own runtime (one script per rank, default) or PyTorch's "
                        "parallel stack (one SPMD script, train_torch.py: DeviceMesh, DTensor, FSDP2, pipelining)")
    p.add_argument("-o", "--output", default="build", help="build directory (default build)")
    _add_force(p)
    p.set_defaults(func=verbs.cmd_codegen)


def _add_batch_source_flags(p) -> None:
    """codegen: where each step's batch comes from (a batch factory, or a dataset)."""
    p.add_argument("--data-ref", help="batch factory (default: example_batch in the model's file)")
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="batch factory keyword (default: the model's --arg values)")
    add_dataset_flags(p)


def _add_training_flags(p) -> None:
    """codegen: the loss, the optimizer and its schedule, initialisation, seeds, gradient buckets, evaluation
    and clipping."""
    p.add_argument("--loss", default="cross_entropy", choices=["cross_entropy", "mse"])
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--lr", type=positive_number, default=0.1)
    p.add_argument("--momentum", type=nonnegative_number, default=0.0)
    p.add_argument("--weight-decay", type=nonnegative_number, default=0.0)
    add_flags(p, count, nonnegative_number)  # optimizer implementation, decay groups, lr schedule
    p.add_argument("--seed", type=count(0, 2 ** 32), default=0, help="parameter initialisation seed")
    p.add_argument("--data-seed", type=count(0, 2 ** 32), default=1000,
                   help="step s reads the batch of seed data_seed + s")
    p.add_argument("--init", default="seed", choices=["seed", "per-module", "checkpoint"])
    p.add_argument("--checkpoint", help="state_dict file for --init checkpoint")
    p.add_argument("--bucket-mb", type=positive_number, default=25.0, help="gradient bucket size in MiB")
    _add_eval_flags(p, "")
    p.add_argument("--clip-grad", type=positive_number, default=None, metavar="MAX_NORM",
                   help="clip the global gradient norm (the whole model's, every plan alike) to MAX_NORM before "
                        "each optimizer step, as torch.nn.utils.clip_grad_norm_ (default: no clipping)")
    p.add_argument("--no-grad-norm", dest="grad_norm", action="store_false",
                   help="compute the global gradient norm only where the step needs it (--clip-grad, fp16 loss "
                        "scaling) instead of every step for metrics.jsonl's grad_norm (then null) and --verify: "
                        "saves reading every gradient once per step")


def _add_loss_scale_flags(p) -> None:
    """codegen: fp16's dynamic loss scaling."""
    p.add_argument("--loss-scale-init", type=positive_number, default=None, metavar="SCALE",
                   help="--dtype fp16: the first dynamic loss scale (default 65536, GradScaler's)")
    p.add_argument("--loss-scale-growth-interval", type=count(1, 2 ** 31), default=None, metavar="STEPS",
                   help="--dtype fp16: double the loss scale after this many steps without overflow (default 2000)")
    p.add_argument("--no-loss-scale", action="store_true",
                   help="--dtype fp16 without dynamic loss scaling (on by default for fp16)")


_EPILOG_RUN = """examples:
  meshplan run build --steps 3 --verify
  meshplan run build --steps 10 --backend mpi
  meshplan run build --steps 10 --checkpoint-dir ckpt --save-every 5; meshplan run build --steps 10 --resume ckpt
  meshplan run build --steps 20000 --no-trace
Writes build/metrics.jsonl (a line per step as it ends: loss, seconds, lr, grad_norm, loss_scale,
samples_per_s, tokens_per_s, mfu, peak_memory_bytes), build/timeline.json and build/trace.json
(the first {window} steps; every step with --trace, none with --no-trace). A NaN or infinite loss stops
the run at the step where it appears (exit 1, naming the step)."""


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run a generated build on this machine (optionally verify it)",
                       epilog=_EPILOG_RUN.format(window=TRACE_WINDOW_STEPS),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build", metavar="BUILD_DIR")
    p.add_argument("--steps", type=STEPS, default=1, help="training steps (default 1)")
    p.add_argument("--backend", default=Backend.GLOO.value, choices=tuple(Backend))
    p.add_argument("--timeout", type=positive_number, default=120.0, help="seconds any communication may take")
    p.add_argument("--heartbeat-timeout", type=positive_number, default=30.0,
                   help="seconds without a heartbeat after which a rank is named as not responding (stopped, "
                        "hung or dead) and the run stops; independent of --timeout (default 30)")
    p.add_argument("--verify", action="store_true",
                   help="also run the single-process reference; exit 1 if loss or parameters differ, 3 if the "
                        "model draws random numbers in training (dropout), which rules out a sample-exact check")
    p.add_argument("--track-memory", action="store_true",
                   help="measure each rank's peak memory in one step, the second of 3 or more (for meshplan compare)")
    p.add_argument("--probe-comm", action="store_true",
                   help="time a 1 MiB all-reduce over all ranks before the first step (meshplan compare sets it "
                        "beside the calibrated time and warns when the machine moves data at another speed)")
    p.add_argument("--rtol", type=nonnegative_number, default=None,
                   help="--verify: relative tolerance of each step's loss and gradients (default: from the dtype)")
    p.add_argument("--atol", type=nonnegative_number, default=None,
                   help="--verify: absolute gradient tolerance, per rms of the gradients (default: from the dtype)")
    p.add_argument("--checkpoint-dir", help="save sharded checkpoints here (after the last step, or --save-every)")
    p.add_argument("--save-every", type=STEPS, help="also save every N steps")
    p.add_argument("--resume", metavar="CHECKPOINT",
                   help="continue from a checkpoint (a step_XXXXXXXX directory, or the newest under a checkpoint dir): "
                        "steps are numbered on from the checkpoint's, and metrics.jsonl keeps the earlier steps")
    p.add_argument("--resume-from-other-run", action="store_true",
                   help="allow --resume from a checkpoint of another run than the one whose checkpoints "
                        "--checkpoint-dir holds (that run continues from this state)")
    _add_eval_flags(p, " (default: the build's)")
    trace = p.add_mutually_exclusive_group()
    trace.add_argument("--trace", action="store_true",
                       help=f"trace every step into timeline.json and trace.json (default: the first "
                            f"{TRACE_WINDOW_STEPS} steps of the run, so that a long run's trace stays small)")
    trace.add_argument("--no-trace", action="store_true", help="trace no step (no timeline.json, trace.json)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write metrics.jsonl's scalars as TensorBoard event files under DIR "
                        "(pip install 'meshplan[tensorboard]')")
    p.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true",
                   help="no live progress display (default: a bar with ETA on a terminal, else a line every 10 s)")
    p.set_defaults(func=verbs.cmd_run)


_EPILOG_CHECKPOINT = """examples:
  meshplan run build --steps 100 --checkpoint-dir ckpt --save-every 10
  meshplan run build --steps 100 --resume ckpt              # the newest complete checkpoint
  meshplan checkpoint show ckpt
  meshplan checkpoint convert ckpt -o model.pt              # one state_dict, the model's own names
A checkpoint of one plan resumes on another plan of the same model (re-sliced on load)."""


def _add_checkpoint(sub) -> None:
    p = sub.add_parser("checkpoint", help="show a sharded checkpoint, or convert it to one state_dict file",
                       epilog=_EPILOG_CHECKPOINT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["show", "convert"])
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a step_XXXXXXXX directory, or a --checkpoint-dir")
    p.add_argument("-o", "--output", default="model.pt",
                   help="state_dict file for convert (default model.pt; never inside a checkpoint directory)")
    _add_force(p)
    p.set_defaults(func=verbs.cmd_checkpoint)


_EPILOG_CALIBRATE = """examples:
  meshplan calibrate --out cluster.yaml                 # quick: 2 ranks on 2 cores, under a minute
  meshplan calibrate --full --ranks 4 --out cluster.json
  meshplan calibrate --device cuda --out h100.yaml --op-table h100_ops.csv   # a GPU: under 2 minutes quick
  meshplan optimize examples/models/gpt.py:build --arg preset=tiny --cluster cluster.yaml --batch 16
On CPUs (--device cpu, the default without a GPU): starts RANKS processes that time the cost
model's op kinds and the runtime's collectives and p2p, fits per-kind efficiencies and
alpha-beta per group size, then trains a small probe transformer data-parallel through the
runtime (traced, 5 launches) to fit how much longer forward and backward take in a run than
their per-op prices. On a GPU (--device cuda, the default where there is one): times the op
table of that one device with CUDA events (GEMMs by shape and dtype, attention, norms,
elementwise ops, the loss, AdamW, copies, the host's launch and layer costs; no collectives:
one GPU has no peer) and fits the GPU cost model to it. Either way it writes a cluster file
(fits under measurements fit.*, raw numbers under raw.*) that Cluster.load reads back."""


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine with the runtime and write a calibrated cluster file",
                       epilog=_EPILOG_CALIBRATE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", "-o", required=True, help="cluster file to write (.yaml, .yml or .json)")
    _add_force(p)
    p.add_argument("--ranks", type=count(2, MAX_RANKS, " (processes on this machine)"),
                   help="rank processes (default: one per usable CPU, at least 2)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="few repeats and message sizes, on a GPU fewer op shapes: under 2 minutes (the default)")
    mode.add_argument("--full", action="store_true",
                      help="more repeats and message sizes (about 4x longer); on a GPU every shape of the H100 op table")
    p.add_argument("--backend", default=None, choices=[Backend.GLOO.value, Backend.MPI.value],
                   help="the CPU processes' communicator (default gloo)")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                   help="what to calibrate: CPU processes, or one CUDA device's op table (default: cuda when "
                        "this machine has a GPU, else cpu)")
    p.add_argument("--op-table", metavar="OUT.csv",
                   help="--device cuda: also write the measured op rows as CSV (the columns of the H100 op table)")
    p.add_argument("--timeout", type=positive_number, default=300.0,
                   help="seconds the CPU measurement may take")
    p.add_argument("--no-run-probe", dest="run_probe", action="store_false",
                   help="CPU: skip the last part: training a small probe transformer through the runtime, traced, "
                        "to measure how much longer compute takes in a run than its per-op prices "
                        "(fit.in_run.*; about 25 s on 2 cores)")
    p.set_defaults(func=verbs.cmd_calibrate)


_EPILOG_COMPARE = """examples:
  meshplan calibrate --out cluster.yaml
  meshplan run build --steps 6 --track-memory --probe-comm
  meshplan compare build --cluster cluster.yaml     # also draws build/compare_schedule.png|svg
Prints predicted (the simulator on the build's Programs, priced on the cluster) versus
measured step time, the error per instruction kind, peak memory per rank, and (after
--probe-comm) a 1 MiB all-reduce's time in the run beside its time at calibration."""


_EPILOG_SIMULATE = """examples:
  meshplan simulate build --cluster cluster.yaml
Writes build/predicted_timeline.json and build/predicted_trace.json (ui.perfetto.dev)."""


def _add_compare(sub) -> None:
    for verb, helptext, epilog, func in (
            ("compare", "predicted versus measured step time, per instruction kind, and peak memory of a run",
             _EPILOG_COMPARE, verbs.cmd_compare),
            ("simulate", "simulate a build's Programs: the predicted timeline", _EPILOG_SIMULATE, verbs.cmd_simulate)):
        p = sub.add_parser(verb, help=helptext, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("build", metavar="BUILD_DIR")
        p.add_argument("--cluster", default="local", metavar="PRESET_OR_FILE",
                       help="cluster to price on; a calibrated file (meshplan calibrate) is best (default: local)")
        if verb == "compare":
            p.add_argument("--no-pictures", action="store_true", help="do not draw the schedules")
        p.set_defaults(func=func)


def _add_force(p) -> None:
    p.add_argument("--force", action="store_true", help="replace output files that exist (default: refuse them)")


def _add_eval_flags(p, default: str) -> None:
    p.add_argument("--eval-every", type=STEPS, metavar="N",
                   help="after every N-th training step, evaluate on held-out batches (forward only): their "
                        "loss and, for class targets, accuracy" + default)
    p.add_argument("--eval-batches", type=STEPS, metavar="K",
                   help="held-out global batches per evaluation" + (default or " (default 1)"))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("meshplan: interrupted", file=sys.stderr)
        return INTERRUPTED
    try:
        return args.func(args)
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"meshplan {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was written stays; one line, the shell's status
        print(f"meshplan {args.verb}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
