"""Real, unchanged models train in parallel exactly like the single process: Hugging Face GPT-2 (tied
embeddings, an odd 1001-token vocabulary), Llama (grouped-query attention), BERT masked-LM (tied
head), T5 (encoder-decoder, tied head) and ViT, built from small configs and captured by
torch.export; and a ResNet-50-style CNN with BatchNorm, captured by torch.fx.

Every build runs as real processes over gloo and passes `--verify` (runtime/verify/__init__.py): each step's
loss, gradients and BatchNorm statistics from the run's own parameters, and the trajectory. The
builds of one world size share one set of worker processes (Python, torch and transformers start
once).
"""

import json

import pytest
import torch

from examples.models import hf, resnet50
from runtime.checkpoint.restore import assemble_files, to_state_dict
from runtime.launch.launcher import run_local, run_many
from runtime.program import Program
from runtime.reference import reference_run
from runtime.spec import StageSpec, TrainSpec
from runtime.verify.step_record import load_records, step_files
from runtime.verify import stats_groups
from runtime.verify.rounding import MARGIN, nudge
from tests.real_models import CONFIGS, HF, HF_ARCHS, assert_verified, emit_fixed, emit_optimized

TWO_RANKS = ("d2", "d2_zero3", "t2", "p2_interleaved")
# the other knobs, each on a model where it matters: (model kwargs, config, micro-batch)
EXTRA_TWO = {
    "llama_t2_recompute_full": ({"arch": "llama"}, dict(tensor=2, recompute="full"), 2),
    "t5_p2_recompute_selective": ({"arch": "t5"}, dict(pipeline=2, recompute="selective"), 2),
    "llama_subgraph2": ({"arch": "llama"}, dict(subgraph=2), 2),          # SwiGLU's gate and up paths apart
    "gpt2_p2_bidirectional": ({"arch": "gpt2"}, dict(pipeline=2, bidirectional=True), 4),   # tie in the pair
}
EXTRA_FOUR = {
    "gpt2_d2p2_zero3": ({"arch": "gpt2"}, dict(data=2, pipeline=2, zero=3), 2),   # tie summed over ZeRO shards
    "bert_d2t2": ({"arch": "bert"}, dict(data=2, tensor=2), 2),                  # odd vocabulary padded, tied head
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("real_models")


@pytest.fixture(scope="module")
def two_rank_runs(root):
    builds = {f"{a}_{c}": emit_fixed(root, HF, {"arch": a}, f"{a}_{c}", CONFIGS[c]) for a in HF_ARCHS
              for c in TWO_RANKS}
    builds.update({name: emit_fixed(root, HF, kw, name, cfg, micro=mb) for name, (kw, cfg, mb) in EXTRA_TWO.items()})
    return dict(zip(builds, run_many(list(builds.values()), steps=3, timeout=60, verify=True)))


@pytest.fixture(scope="module")
def four_rank_runs(root):
    """The 4-rank builds' verified runs; gpt2_d2p2 also saves its checkpoint (root/gpt2_d2p2_ckpt)."""
    builds = {f"{a}_d2p2": emit_fixed(root, HF, {"arch": a}, f"{a}_d2p2", CONFIGS["d2p2"]) for a in HF_ARCHS}
    builds.update({f"{a}_optimized": emit_optimized(root, HF, {"arch": a}, f"{a}_optimized") for a in HF_ARCHS})
    builds.update({name: emit_fixed(root, HF, kw, name, cfg, micro=mb) for name, (kw, cfg, mb) in EXTRA_FOUR.items()})
    own = {"gpt2_d2p2": ["--checkpoint-dir", str(root / "gpt2_d2p2_ckpt")]}
    return dict(zip(builds, run_many(list(builds.values()), steps=3, timeout=60, verify=True,
                                     build_args=[own.get(n, []) for n in builds])))


@pytest.mark.parametrize("arch", HF_ARCHS)
@pytest.mark.parametrize("config", TWO_RANKS)
def test_hugging_face_model_on_two_ranks_equals_single_process(two_rank_runs, arch, config):
    assert_verified(two_rank_runs[f"{arch}_{config}"], f"{arch} {config}")


@pytest.mark.parametrize("arch", HF_ARCHS)
@pytest.mark.parametrize("config", ("d2p2", "optimized"))
def test_hugging_face_model_on_four_ranks_equals_single_process(four_rank_runs, arch, config):
    assert_verified(four_rank_runs[f"{arch}_{config}"], f"{arch} {config}")


@pytest.mark.parametrize("name", sorted(EXTRA_TWO))
def test_recompute_subgraph_and_bidirectional_on_two_ranks(two_rank_runs, name):
    assert_verified(two_rank_runs[name], name)


@pytest.mark.parametrize("name", sorted(EXTRA_FOUR))
def test_zero3_ties_and_padded_tensor_parallelism_on_four_ranks(four_rank_runs, name):
    assert_verified(four_rank_runs[name], name)


def test_tied_weight_across_stages_is_summed_and_converted_tied(root, four_rank_runs, tmp_path):
    """GPT-2's token embedding and output layer, cut into two stages under data 2 x pipeline 2: each
    stage holds a copy, the copies' gradients are summed (ALLREDUCE tied), the checkpoint of its 3-step
    run converts to a state_dict that loads strict into the model and leaves it tied, equal to the reference."""
    build = root / "gpt2_d2p2"
    programs = (build / "programs.json").read_text()
    assert '"kind": "tied"' in programs and "tie:0,1" in programs
    ckpt = root / "gpt2_d2p2_ckpt"
    res = four_rank_runs["gpt2_d2p2"]
    assert res.returncode == 0, res.output[-3000:]
    to_state_dict(ckpt, tmp_path / "model.pt")
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    model = hf.build(arch="gpt2")
    model.load_state_dict(sd, strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    spec = TrainSpec.from_dict(json.loads((build / "build.json").read_text())["train"])
    ref = reference_run(spec, 3, micro_batch_size=2)
    torch.testing.assert_close(model.transformer.wte.weight.detach(), ref.params["transformer.wte.weight"],
                               rtol=1e-4, atol=1e-6)


# ---- the ResNet-50-style CNN (BatchNorm), 10 steps ------------------------------------------------

CNN = "examples/models/resnet50.py:build"
CNN_KW = {"width": 8, "num_classes": 10, "image_size": 64}
CNN_SGD = {"name": "sgd", "lr": 0.01, "momentum": 0.9}


@pytest.mark.parametrize("name,cfg", [("cnn_d2p2", CONFIGS["d2p2"]), ("cnn_t2", CONFIGS["t2"])])
def test_resnet50_cnn_trains_ten_steps_equal_to_single_process(root, tmp_path, name, cfg):
    """10 steps pass --verify (buffers included); the converted checkpoint loads strict and its BatchNorm
    statistics equal the single-process run's (each data rank's micro-batches, averaged)."""
    build = emit_fixed(root, CNN, CNN_KW, name, cfg, optimizer=CNN_SGD)
    ckpt = tmp_path / "ckpt"
    res = run_local(build, steps=10, timeout=120, verify=True, extra_args=["--checkpoint-dir", str(ckpt)])
    assert_verified(res, name)
    to_state_dict(ckpt, tmp_path / "model.pt")
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    model = resnet50.build(**{k: v for k, v in CNN_KW.items() if k != "image_size"})
    model.load_state_dict(sd, strict=True)
    stats = [k for k in sd if k.endswith(("running_mean", "running_var"))]
    assert len(stats) == 2 * sum(1 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    # the checkpoint holds what every data rank holds after the last step (their average) ...
    programs = {int(r): Program.from_dict(d) for r, d in json.loads((build / "programs.json").read_text()).items()}
    last = assemble_files(step_files(load_records(build / "run", len(programs)), 9), programs[0].mesh)
    for k in stats:
        assert torch.equal(sd[k], last.buffers[k]), k
    # ... which --verify found equal to the single process's step by step; over the whole run they
    # stay as close as a rounding-level twin of the single process stays to it
    info = json.loads((build / "build.json").read_text())
    specs = {int(s): StageSpec.from_dict(d) for s, d in info["stages"].items()}
    spec, groups = TrainSpec.from_dict(info["train"]), stats_groups(programs, specs, False)
    ref = reference_run(spec, 10, micro_batch_size=2, stats_groups=groups)
    twin = reference_run(spec, 10, micro_batch_size=2, stats_groups=groups, perturb=nudge)
    for k in stats:
        allow = MARGIN * (twin.buffers[k] - ref.buffers[k]).norm() + 1e-5 * ref.buffers[k].norm()
        assert (sd[k] - ref.buffers[k]).norm() <= allow, k
