"""`meshplan codegen --target torch`: the one generated SPMD script trains the example GPT, a Hugging Face
Llama and a BERT with PyTorch's own parallel stack (DeviceMesh, DTensor tensor parallelism, FSDP2,
torch.distributed.pipelining's 1F1B and interleaved schedules) and equals the single-process run: every build runs as real processes over gloo and passes `--verify`
(runtime/verify/__init__.py: each step's loss, gradients and global gradient norm from the run's own parameters,
then the trajectory's losses and final parameters).

Every model under every configuration; the builds of one world size
share one set of worker processes (runtime/launch/worker.py), and one GPT build goes through the CLI
(`meshplan codegen --target torch`, `meshplan run --verify`) as a user would.
"""

import json

import planner
import pytest

from codegen.torch_target.script import SCRIPT, emit_torch
from planner.app.cli import main
from planner.app.commands import make_fixed_plan
from runtime.launch.launcher import run_many
from runtime.vocab import Target
from tests.real_models import CONFIGS, HF, SGD, assert_verified, graph_of

GPT = "examples/models/gpt.py:build"
D2T2 = dict(data=2, tensor=2)
MODELS = {"gpt": (GPT, {}), "llama": (HF, {"arch": "llama"}), "bert": (HF, {"arch": "bert"})}
# name -> (model reference, its arguments, configuration): every model under every configuration the
# issue names (data 2, data 2 ZeRO-3, tensor 2, pipeline 2 interleaved on 2 ranks; data 2 x tensor 2 and
# data 2 x pipeline 2 1F1B on 4); BERT's interleaved pipeline puts its tied embedding on two positions
TWO_RANKS = {f"{m}_{c}": (*MODELS[m], CONFIGS[c]) for m in MODELS for c in ("d2", "d2_zero3", "t2", "p2_interleaved")}
FOUR_RANKS = {**{f"{m}_d2t2": (*MODELS[m], D2T2) for m in MODELS},
              **{f"{m}_d2p2": (*MODELS[m], CONFIGS["d2p2"]) for m in MODELS}}


def emit_torch_fixed(root, name: str, ref: str, kwargs: dict, cfg: dict):
    """The torch build of the model under configuration `cfg` (micro-batch 2, global batch 8)."""
    graph = graph_of(ref, tuple(sorted(kwargs.items())))
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=config.num_devices), config, 8, Target.TORCH)
    return emit_torch(plan, ref, None, root / name, model_kwargs=kwargs, graph=graph, optimizer=SGD).path


def _run(root, cases: dict) -> dict:
    builds = {name: emit_torch_fixed(root, name, *case) for name, case in cases.items()}
    return dict(zip(builds, run_many(list(builds.values()), steps=3, timeout=60, verify=True)))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("torch_script")


@pytest.fixture(scope="module")
def two_rank_runs(root):
    return _run(root, TWO_RANKS)


@pytest.fixture(scope="module")
def four_rank_runs(root):
    return _run(root, FOUR_RANKS)


@pytest.mark.parametrize("name", sorted(TWO_RANKS))
def test_torch_script_on_two_ranks_equals_single_process(two_rank_runs, name):
    assert_verified(two_rank_runs[name], name)
    assert two_rank_runs[name].comparison.norms_compared == 3   # the global norm over the meshes, every step


@pytest.mark.parametrize("name", sorted(FOUR_RANKS))
def test_torch_script_on_four_ranks_equals_single_process(four_rank_runs, name):
    assert_verified(four_rank_runs[name], name)


def test_cli_writes_a_torch_build_and_runs_it_with_verify(tmp_path, capsys):
    out = tmp_path / "gpt_d2"
    assert main(["codegen", GPT, "--batch", "8", "--data", "2", "--micro-batch", "2", "--lr", "0.05",
                 "--momentum", "0.9", "--target", "torch", "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["build.json", "graph.json", "launch_srun.sh",
                                                      "launch_torchrun.sh", "plan.json", SCRIPT]
    info = json.loads((out / "build.json").read_text())
    assert (info["target"], info["entry"], info["world_size"]) == ("torch", SCRIPT, 2)
    assert "replicate(model, mesh=mesh['data'])" in (out / SCRIPT).read_text()
    capsys.readouterr()
    assert main(["run", str(out), "--steps", "3", "--verify", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "verify against the single-process reference: OK: 3 step(s)" in printed
    assert len(json.loads((out / "run" / "rank_0001.json").read_text())["losses"]) == 3
