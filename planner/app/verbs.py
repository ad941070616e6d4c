"""What each `meshplan` verb does, given its parsed arguments (planner/app/cli.py defines the arguments and
hands them here). Each returns the process's exit status; user errors raise ValueError, which the CLI prints
as one line.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Any, Sequence

import torch

from cost_models import local_machine
from cost_models.calibration.gpu_calibrate import calibrate_gpu, calibration_device
from cost_models.hardware import Cluster
from cost_models.presets import LOCAL_PRESET
from cost_models.op_table import format_op_table, measured_rows
from cost_models.overlap import Overlap, stack_selective
from cost_models.simulate import simulate_steady
from planner.app import calibrate_run
from planner.app.cli_args import MAX_WORLD, OutputError, check_constraints, output_dir, output_file, refuse_existing
from planner.app.commands import codegen_command, read_checked_build, run_command
from planner.app.build_costs import predicted_costs
from planner.app.compare import compare_build, draw
from planner.app.report import write_report
from planner.app.visualize import FIGURES, FORMATS, output_stem, visualize
from planner.graph.capture import capture_ref
from planner.search import explain, optimize
from planner.plan import Plan
from runtime.checkpoint import Manifest, check_rank_files, complete_checkpoints, enclosing_checkpoint, \
    is_torch_checkpoint, resolve_checkpoint
from runtime.checkpoint.restore import to_state_dict
from runtime.launch.launcher import read_build
from runtime.vocab import Backend, Target


def _parse_kv(items: Sequence[str]) -> dict[str, Any]:
    """`key=value` pairs; values are Python literals when they parse as one, else strings."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--arg {item!r} is not KEY=VALUE (for example --arg num_layers=4)")
        key, raw = item.split("=", 1)
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def _check_world(devices: int, what: str) -> None:
    if devices > MAX_WORLD:
        raise ValueError(f"{what} has {devices} devices; meshplan plans at most {MAX_WORLD}: "
                         "use fewer --nodes/--devices")


def resolve_cluster(name: str, nodes: int | None = None, devices: int | None = None):
    """A preset name (with nodes/devices) or a cluster file path."""
    if name in Cluster.preset_names():
        return Cluster.preset(name, nodes=nodes, devices=devices)
    if Path(name).suffix in (".yaml", ".yml", ".json") or Path(name).exists():
        if nodes or devices:
            raise ValueError("--nodes/--devices apply to presets; edit the cluster file instead")
        return Cluster.load(name)
    raise ValueError(f"{name!r} is neither a preset ({', '.join(Cluster.preset_names())}) "
                     "nor a cluster file (.yaml/.yml/.json)")


def cmd_capture(args: argparse.Namespace) -> int:
    if args.output:
        output_file(args.output, force=args.force)
    graph = capture_ref(args.model, _parse_kv(args.arg), args.batch)
    print(graph.summary(max_layers=args.max_layers))
    if args.output:
        graph.save(args.output)
        print(f"\nwrote {args.output}")
    return 0


def cmd_optimize(args: argparse.Namespace) -> int:
    output_file(args.output, force=args.force)
    constraints = check_constraints(_parse_kv(args.constraint))
    cluster = resolve_cluster(args.cluster, args.nodes, args.devices)
    _check_world(cluster.num_devices, "the cluster")
    graph = capture_ref(args.model, _parse_kv(args.arg), 1)
    if args.what_if and args.target != Target.MESHPLAN:
        raise ValueError(f"--what-if searches what no target runs yet; drop --target {args.target} or --what-if")
    stack = {"overlap": Overlap.preset(args.stack), "selective": stack_selective(args.stack)} \
        if args.stack else {}   # else the target's stack
    plan = optimize(graph, cluster, global_batch_size=args.batch, objective=args.objective,
                    constraints=constraints, progress=False if args.quiet else None, **stack,
                    **({"runtime": None} if args.what_if else {"target": args.target}))
    print(plan.summary())
    print()
    print(explain(plan))
    plan.save(args.output)
    print(f"\nwrote {args.output}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    out = args.output or str(Path(args.plan).with_suffix(""))
    report = f"{out}_report.html" if not out.endswith("/") else f"{out}report.html"
    if out.endswith("/"):  # a directory: the pictures go inside it
        output_dir(out)
    else:
        output_file(report, force=args.force)
    directory, prefix = output_stem(out)
    refuse_existing([report, *(directory / f"{prefix}{name}.{fmt}" for name in FIGURES for fmt in FORMATS)], "-o",
                    args.force)
    print(plan.summary())
    print()
    print(explain(plan))
    files = visualize(plan, out)
    report = write_report(plan, report)
    # a directory holds mesh.png, memory.png, ...; a stem gets stem_mesh.png, stem_memory.png, ...
    pattern = Path(out) / "*" if out.endswith("/") else Path(f"{out}_*")
    print(f"\nwrote {len(files)} pictures ({pattern}.png|svg) and {report}")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    if args.output:
        output_file(args.output, force=args.force)
    if args.remeasure:
        if args.name != LOCAL_PRESET:
            raise ValueError(f"--remeasure measures this machine: it applies to 'meshplan cluster {LOCAL_PRESET}', "
                             f"not to {args.name!r}")
        figures = local_machine.load_or_measure(remeasure=True)   # and cached for every later use
        cluster = Cluster.preset(LOCAL_PRESET, devices=args.devices, figures=figures)
        print(f"measured this machine now ({figures['measure_seconds']:.1f} s, load {figures['load_per_cpu']:.2f} "
              f"per CPU{', busy: measure again when it is quieter' if local_machine.is_busy(figures) else ''}); "
              f"cached in {local_machine.default_cache_dir() / local_machine.CACHE_FILE_NAME}")
    else:
        cluster = resolve_cluster(args.name, args.nodes, args.devices)
    _check_world(cluster.num_devices, "the cluster")
    print(cluster.summary())
    if args.output:
        cluster.save(args.output)
        print(f"\nwrote {args.output}")
    return 0


def cmd_codegen(args: argparse.Namespace) -> int:
    data_kwargs = _parse_kv(args.data_arg) if args.data_arg else None
    args.dataset_kwargs = _parse_kv(args.dataset_arg)
    args.eval_dataset_kwargs = _parse_kv(args.eval_dataset_arg) if args.eval_dataset_arg else None
    _build_output(args.output, args.force)   # emit creates it once the build is complete: a refusal leaves none
    return codegen_command(args, _parse_kv(args.arg), data_kwargs)


def _build_output(path: str, force: bool) -> None:
    """codegen's -o: a new directory, or a build it replaces; a directory of other files only with --force."""
    out = Path(path).expanduser()
    try:
        others = out.is_dir() and not (out / "build.json").is_file() and any(out.iterdir())
    except OSError:   # a directory we may not list: output_dir says so
        others = False
    if others and not force:
        raise OutputError(f"-o {path} is a directory with other files than a meshplan build; codegen would write "
                          "among them: pass --force, or give a new directory")
    output_dir(path, create=False)


def cmd_run(args: argparse.Namespace) -> int:
    if args.backend == Backend.NCCL:
        if not torch.cuda.is_available():
            raise ValueError("--backend nccl needs CUDA GPUs, and torch sees none here "
                             f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
                             "use --backend gloo or mpi on CPUs")
    if args.checkpoint_dir:
        output_dir(args.checkpoint_dir, "--checkpoint-dir")
    if args.resume:  # here, not after every rank has started and built its model
        if read_build(args.build).get("target") == Target.TORCH:   # its checkpoints are DCP directories, checked
            _torch_checkpoints().checked(args.resume)
        else:
            check_rank_files(resolve_checkpoint(args.resume))
    return run_command(args)


def _torch_checkpoints():
    """runtime.torch_script_checkpoint, imported where a torch build's checkpoint is read: it imports torch's
    Distributed Checkpoint and DTensor, which every other command would pay for at start-up (about 1 s)."""
    from runtime import torch_script_checkpoint

    return torch_script_checkpoint


def cmd_checkpoint(args: argparse.Namespace) -> int:
    torch_ckpt = is_torch_checkpoint(args.checkpoint)
    torch_checkpoints = _torch_checkpoints() if torch_ckpt else None
    if args.action == "convert":
        inside = enclosing_checkpoint(args.output)
        if inside is not None:   # even with --force: a checkpoint holds what its run wrote, nothing else
            raise OutputError(f"-o {args.output} is inside the checkpoint directory {inside}; write the state_dict "
                              "elsewhere")
        output_file(args.output, force=args.force)
        ckpt, info, n = (torch_checkpoints.to_state_dict if torch_ckpt else to_state_dict)(args.checkpoint,
                                                                                            args.output)
        print(f"wrote {args.output}: {n} tensors of {info.model_ref} at step {info.step} (from {ckpt})")
        return 0
    if torch_ckpt:
        ckpt, info = torch_checkpoints.checked(args.checkpoint)
        print(f"{ckpt}: a torch build's Distributed Checkpoint, step {info.step} ({info.samples} samples), model "
              f"{info.model_ref}, run {info.run_id}, {len(info.files) or 'no'} files with sha256 checked")
        return 0
    ckpt = resolve_checkpoint(args.checkpoint)
    man = Manifest.load(ckpt)
    print(f"{ckpt}: step {man.step} ({man.samples} samples), {man.world_size} ranks, mesh "
          + " x ".join(f"{a} {s}" for a, s in man.mesh) + f", model {man.model_ref}, optimizer {man.optimizer}")
    done = complete_checkpoints(ckpt.parent)
    if len(done) > 1:
        print("complete checkpoints here: " + ", ".join(d.name for d in done))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    if Path(args.out).suffix.lower() not in (".yaml", ".yml", ".json"):
        raise ValueError(f"--out {args.out}: name the cluster file .yaml, .yml or .json")
    device = calibration_device(args.device)
    if device.type == "cuda":
        for flag, given in (("--ranks", args.ranks is not None), ("--backend", args.backend is not None)):
            if given:
                raise ValueError(f"{flag}: a GPU calibration measures this one device in this process (collectives "
                                 "are not measured on one GPU); leave it out, or calibrate CPU processes with "
                                 "--device cpu")
    elif args.op_table:
        raise ValueError(f"--op-table {args.op_table}: the op table is measured on a GPU (--device cuda); this "
                         f"calibration runs on {device.type.upper()} processes")
    if args.op_table and Path(args.op_table).suffix.lower() != ".csv":
        raise ValueError(f"--op-table {args.op_table}: name the op table .csv")
    output_file(args.out, "--out", force=args.force)  # before minutes of measuring
    if args.op_table:
        output_file(args.op_table, "--op-table", force=args.force)
    progress = lambda line: print(line, flush=True)  # noqa: E731
    if device.type == "cuda":
        cluster = calibrate_gpu(device, quick=not args.full, progress=progress)
    else:
        cluster = calibrate_run.calibrate_machine(args.ranks, quick=not args.full, backend=args.backend or Backend.GLOO.value,
                                                  timeout=args.timeout, run_probe=args.run_probe, progress=progress)
    cluster.save(args.out)
    print()
    print(cluster.summary().split("\n  measurements:")[0])
    print(f"\nwrote {args.out}")
    if args.op_table:
        rows = measured_rows(cluster.measurements)
        Path(args.op_table).expanduser().write_text(format_op_table(rows))
        print(f"wrote {args.op_table} ({len(rows)} op rows)")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    read_checked_build(args.build)
    cluster = resolve_cluster(args.cluster)
    cmp, predicted, measured, plan = compare_build(args.build, cluster)
    print(cmp.report())
    if not args.no_pictures:
        paths = draw(plan, predicted, measured, cmp.typical_step, Path(args.build) / "compare_schedule")
        print(f"wrote {paths[0]} and .svg (predicted beside measured step {cmp.typical_step})")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    read_checked_build(args.build)
    _plan, pred, costs, progs, cluster = predicted_costs(args.build, resolve_cluster(args.cluster))
    tl = simulate_steady(progs, costs, cluster)  # a step after the first, as `compare` measures
    out = Path(args.build)
    tl.save(out / "predicted_timeline.json")
    tl.save_chrome(out / "predicted_trace.json")
    print(f"simulated step (steady state) on {cluster.name!r}: {tl.step_times()[0] * 1e3:.3f} ms "
          f"(analytic {pred.step_time * 1e3:.3f} ms); {len(tl.events)} instructions on {len(progs)} ranks")
    print(f"wrote {out / 'predicted_timeline.json'} and {out / 'predicted_trace.json'} (ui.perfetto.dev)")
    return 0
