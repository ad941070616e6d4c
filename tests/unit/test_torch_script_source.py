"""The torch target's generated script (codegen/torch_target/script.py) as source: one script for every
rank, compiled, holding hostile user strings only as data; and the runtime side it leans on
(runtime/torch_script.py): refused launch options, the whole-model view --verify reads, the entry
script a build names."""

from __future__ import annotations

import ast
import json

import pytest

from codegen.torch_target.layout import DataLayout, MeshDim, ModuleStyle, TorchLayout
from codegen.torch_target.script import SCRIPT, TorchTargetError, emit_torch
from codegen.torch_target.script_parallel import parallelize_source
from cost_models.hardware import Cluster
from planner.capabilities import TargetError
from planner.config import ParallelConfig
from planner.graph.capture import capture_ref
from planner.fixed_plan import make_plan
from runtime.execute.evaluation import EvalSpec
from runtime.launch.launcher import BuildError, entry_script
from runtime.execute.loss_scale import LossScaleSpec
from runtime.execute.optim import OptimizerSpec
from runtime.launch.rank_args import LaunchError
from runtime.torch_records import WHOLE_MODEL_KEY, whole_model_view
from runtime.torch_script import check_world, script_args
from runtime.torch_stack.vocab import DataKind, TensorStyle
from runtime.vocab import MeshAxis, RecomputeMode
from tests.hostile_cases import HOSTILE, HOSTILE_DIR, hostile_kwargs, load_rank_script, markers, write_model

SGD = OptimizerSpec(name="sgd", lr=0.1)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """The hostile model file with hostile arguments, planned over data 2: (root, ref, kwargs, graph, plan)."""
    root = tmp_path_factory.mktemp("torch_hostile")
    kwargs = hostile_kwargs()
    ref = f"{write_model(root, kwargs)}:build"
    graph = capture_ref(ref, kwargs, batch_size=2)
    plan = make_plan(graph, Cluster.preset("local", devices=2), ParallelConfig(data=2, micro_batch_size=2, dtype="fp32"),
                     global_batch_size=4)
    return root, ref, kwargs, graph, plan


@pytest.fixture(scope="module")
def hostile_build(hostile):
    root, ref, kwargs, graph, plan = hostile
    return emit_torch(plan, ref, None, root / HOSTILE_DIR / "out" / HOSTILE_DIR, graph=graph, model_kwargs=kwargs,
                      optimizer=SGD, checkpoint=HOSTILE[0], root=str(root / HOSTILE_DIR))


def test_one_script_for_every_rank_that_the_launchers_start(hostile_build):
    build = hostile_build
    assert [p.name for p in build.path.glob("*.py")] == [SCRIPT]      # no rank_XXXX.py, no run_rank.py
    assert f'"$HERE/{SCRIPT}"' in (build.path / "launch_torchrun.sh").read_text()
    assert f"\nENTRY={SCRIPT}\n" in (build.path / "launch_srun.sh").read_text()
    assert not (build.path / "launch_mpirun.sh").exists()                # MPI stays with meshplan's runtime
    info = json.loads((build.path / "build.json").read_text())
    assert entry_script(build.path, info) == build.path / SCRIPT
    assert info[WHOLE_MODEL_KEY] == {"micro_batch_size": 2, "micro_batches": 1}   # 4 samples over 2 data ranks


def test_the_script_compiles_and_holds_hostile_strings_only_as_data(hostile, hostile_build, monkeypatch):
    root, ref, kwargs, *_ = hostile
    text = hostile_build.script.read_text()
    assert "\u2028" not in text and "\r" not in text
    tree = ast.parse(text)
    assert f"Model: {ref} {kwargs}" in ast.get_docstring(tree, clean=False)
    monkeypatch.chdir(root)
    seen = []
    for rank in ("0", "1"):   # its top level is the same whatever rank runs it
        monkeypatch.setenv("RANK", rank)
        ns = load_rank_script(hostile_build.script)
        seen.append((ns["TRAIN"], ns["MESH_AXES"], ns["MESH_SHAPE"], ns["WORLD_SIZE"]))
    assert seen[0] == seen[1]
    train, axes, shape, world = seen[0]
    assert (train.model_ref, train.model_kwargs, train.data_kwargs, train.checkpoint) == (ref, kwargs, kwargs, HOSTILE[0])
    assert (axes, shape, world) == (("data",), (2,), 2)
    assert not markers(root)


def test_setups_the_script_does_not_carry_out_are_refused(hostile, tmp_path):
    _root, ref, kwargs, graph, plan = hostile
    with pytest.raises(TorchTargetError, match="held-out"):
        emit_torch(plan, ref, None, tmp_path / "a", graph=graph, model_kwargs=kwargs, evaluation=EvalSpec(every=1))
    fp16 = make_plan(graph, Cluster.preset("local", devices=2), ParallelConfig(data=2, micro_batch_size=2, dtype="fp16"),
                     global_batch_size=4)
    with pytest.raises(TargetError, match="fp16"):
        emit_torch(fp16, ref, None, tmp_path / "b", graph=graph, model_kwargs=kwargs, loss_scale=LossScaleSpec())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_launch_options_the_script_cannot_honour_are_refused(monkeypatch):
    with pytest.raises(LaunchError, match="does not take --backend mpi, --tensorboard; generate a meshplan build"):
        script_args(["--backend", "mpi", "--resume", "ckpt", "--tensorboard", "tb"], ".")
    assert script_args(["--checkpoint-dir", "c", "--save-every", "2"], ".").save_every == 2   # checkpoints: DCP
    assert script_args(["--steps", "3", "--save-steps", "--no-trace"], ".").steps == 3
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(LaunchError, match="needs 4 processes, but 3 were started"):
        check_world(4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert check_world(4) == 1


def test_the_script_saves_and_resumes_distributed_checkpoints(hostile_build):
    lines = hostile_build.script.read_text().splitlines()
    for line in (
            "from runtime.torch_script_checkpoint import open_checkpoints",
            "        checkpoints = open_checkpoints(args, TRAIN.model_ref, TRAIN.global_batch_size)",
            "    checkpoints.claim(rank)",
            "    first = checkpoints.resume(runner.state, optimizer, scheduler)",
            "        for step in range(first, first + args.steps):",
            "            if checkpoints.due(step + 1, last=step == first + args.steps - 1):",
            "                checkpoints.save(step + 1, rank, runner.state, optimizer, scheduler)",
            "        checkpoints.release()",
            # the state a checkpoint holds: the whole model without pipelines
            "    return Runner([model], model, lambda batches: forward_backward(model, batches), holds_loss=True,"):
        assert line in lines, line
    assert lines.index("    checkpoints.claim(rank)") < lines.index("    first = checkpoints.resume(runner.state, "
                                                                    "optimizer, scheduler)")


def test_verify_reads_a_torch_build_as_rank_0_holding_the_whole_model():
    info = {"world_size": 4, "mesh": {"pipeline": 1, "data": 2, "tensor": 2},
            WHOLE_MODEL_KEY: {"micro_batch_size": 2, "micro_batches": 3}}
    programs, specs = whole_model_view(info)
    (prog,) = programs.values()
    assert (prog.rank, prog.coords, prog.stages, prog.instrs) == (0, (0, 0, 0), (0,), ())
    assert prog.data_shard() == (0, 2) and (prog.num_micro_batches, prog.micro_batch_size) == (3, 2)
    assert specs[0].split_of("blocks.0.attn.qkv.weight", 2) is None   # every tensor whole


def test_a_build_names_only_its_own_scripts(tmp_path):
    (tmp_path / SCRIPT).write_text("")
    with pytest.raises(BuildError, match="'../evil.py' is not a script of the build"):
        entry_script(tmp_path, {"entry": "../evil.py"})
    with pytest.raises(BuildError, match="'run_rank.py' is not a script of the build"):
        entry_script(tmp_path, {})                     # a meshplan build's picker, missing here
    (tmp_path / "run_rank.py").write_text("")
    assert entry_script(tmp_path, {}) == tmp_path / "run_rank.py"
    assert entry_script(tmp_path, {"entry": SCRIPT}) == tmp_path / SCRIPT


def test_a_layout_is_written_out_as_explicit_torch_calls():
    hostile = HOSTILE[0]   # a module path from the model is a literal in the script, never code
    layout = TorchLayout(
        mesh=(MeshDim(MeshAxis.DATA, 2), MeshDim(MeshAxis.TENSOR, 2)),
        tensor=(ModuleStyle("wte", TensorStyle.EMBEDDING_ROWWISE), ModuleStyle("h.0.qkv", TensorStyle.COLWISE_STRIDED, 3),
                ModuleStyle(hostile, TensorStyle.ROWWISE), ModuleStyle("ln", TensorStyle.SEQUENCE),
                ModuleStyle("head", TensorStyle.OUTPUT_COLWISE)),
        sequence_dim=1, data=DataLayout(DataKind.FULLY_SHARD, reshard_after_forward=False, units=("h.0",)),
        recompute=RecomputeMode.FULL, checkpoint_units=("h.0",), ties=(("wte.weight", "head.weight"), ("a.w", "b.w")))
    src = parallelize_source(layout)
    text = "\n".join(src.functions)
    for line in (
            "        'wte': RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),",
            "        'h.0.qkv': StridedColwiseParallel(3, input_layouts=Shard(1)),",
            f"        {hostile!r}: RowwiseParallel(output_layouts=Shard(1)),",
            "        'ln': SequenceParallel(sequence_dim=1, use_local_output=True),",
            "        'head': ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),",
            # the tie goes to the split copy; a group no style touched stays one parameter
            "    setattr(model.get_submodule('head'), 'weight', model.get_parameter('wte.weight'))",
            "        model.get_submodule(parent).register_module(name, checkpoint_wrapper(model.get_submodule(path)))",
            "        fully_shard(model.get_submodule(path), mesh=mesh['data'], reshard_after_forward=False)",
            "    fully_shard(model, mesh=mesh['data'], reshard_after_forward=False)"):
        assert line in text.splitlines(), line
    assert "'b.w'" not in text
    assert text.index("parallelize_module") < text.index("setattr") < text.index("checkpoint_wrapper(") \
        < text.index("fully_shard(")                                  # torchtitan's order
    assert "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, " \
           "parallelize_module" in src.imports
    assert "from runtime.torch_stack.tensor import StridedColwiseParallel" in src.imports
    compile("\n".join(src.imports) + "\n" + text, "parallelize", "exec")


def test_codegen_refuses_a_configuration_the_torch_target_does_not_run_before_capturing(tmp_path, capsys):
    from planner.app.cli import main

    out = tmp_path / "build"
    assert main(["codegen", "examples/models/gpt.py:build", "--batch", "8", "--data", "2", "--recompute", "selective",
                 "--target", "torch", "-o", str(out)]) == 2
    assert "codegen --target torch for d2" in capsys.readouterr().err and not (out / "build.json").exists()
