"""Execution options over real processes (gloo, 2 ranks): compiled stages, the compiled loss, the fused
chunked loss and the padded vocabulary train exactly like the single-process model (`meshplan run
--verify`, today's tolerances), compiled by repeated block or by whole stage, with recomputation,
pipelines (1F1B, interleaved), data parallelism with ZeRO and tensor parallelism (with sequence
parallelism); nothing recompiles after the first step; the padded vocabulary stays out of checkpoints
(`meshplan checkpoint convert` gives the model's own shapes) and a checkpoint of one padding resumes
in another.

One build (the MLP's) compiles with inductor: its C++ compilation takes about a minute on this
machine (a GPT block's, two); the others compile with aot_eager, which captures and differentiates the
same graphs (what recompilation, recomputation and the tensor-parallel autograd functions exercise) but
runs them with eager kernels.
All builds of a world size run in one launch (runtime.launch.worker).
"""

import functools
import json

import pytest
import torch

import planner
from codegen.emit import capture_ref, emit
from planner.app.commands import make_fixed_plan
from runtime.execute.evaluation import EvalSpec
from runtime.checkpoint import step_dir
from runtime.checkpoint.restore import to_state_dict
from runtime.execution import Execution
from runtime.launch.launcher import read_build, run_many
from runtime.materialize import build_model
from runtime.spec import TrainSpec
from runtime.verify import verify_build
from tests.parallel_cases import assert_exact, emit_case, saved_params

pytestmark = pytest.mark.timeout(600)

HF = ("examples/models/hf.py:build", {"arch": "gpt2", "preset": "tiny"})   # tied 1001-token vocabulary
ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}
ALL = dict(compile=True, loss="chunked", vocab_multiple=48)   # GPT tiny's 128 tokens -> 144
QUICK = dict(compile_backend="aot_eager")

# name -> (model, configuration, execution, more emit arguments)
CASES = {
    "mlp_d2_zero1_inductor": ("mlp", dict(data=2, zero=1), Execution(compile=True, loss="chunked", vocab_multiple=16),
                              {}),
    "gpt_d2_zero3": ("gpt", dict(data=2, zero=3), Execution(**ALL, **QUICK), {}),
    "gpt_p2_1f1b_recompute_full": ("gpt", dict(pipeline=2, recompute="full"), Execution(**ALL, **QUICK), {}),
    "gpt_p2_interleaved_selective": ("gpt", dict(pipeline=2, schedule="interleaved", virtual_stages=2,
                                                 recompute="selective"), Execution(compile=True, **QUICK),
                                     {"global_batch": 8, "micro_batch": 1}),
    "gpt_t2": ("gpt", dict(tensor=2), Execution(**ALL, **QUICK), {}),
    "gpt_d2_whole_stage": ("gpt", dict(data=2), Execution(compile=True, compile_scope="stage", **QUICK), {}),
    "gpt_t2_sequence_parallel": ("gpt", dict(tensor=2, sequence_parallel=True),
                                 Execution(loss="chunked", vocab_multiple=48), {}),
    "hf_t2_eval": ("hf", dict(tensor=2), Execution(loss="chunked", vocab_multiple=64),
                   {"optimizer": ADAMW, "evaluation": True}),
    "hf_p2_checkpoint": ("hf", dict(pipeline=2), Execution(loss="chunked", vocab_multiple=64), {"optimizer": ADAMW}),
    "hf_d2_full_loss_padded": ("hf", dict(data=2), Execution(vocab_multiple=64), {"optimizer": ADAMW}),
    # the compiled loss: on a dict output over a padded vocabulary's view, eager stages; and after a pipeline
    "hf_d2_compiled_loss_padded": ("hf", dict(data=2), Execution(loss="compiled", vocab_multiple=64, **QUICK),
                                   {"optimizer": ADAMW}),
    "gpt_p2_compiled_loss": ("gpt", dict(pipeline=2), Execution(compile=True, loss="compiled", **QUICK), {}),
    # stages compiled whole: the last one's forward and the compiled loss in one graph, over a padded vocabulary
    "hf_p2_whole_stage_compiled_loss": ("hf", dict(pipeline=2), Execution(compile=True, compile_scope="stage",
                                                                          loss="compiled", vocab_multiple=64, **QUICK),
                                        {"optimizer": ADAMW}),
}


@functools.lru_cache(maxsize=None)
def _hf_graph():
    return capture_ref(*HF, batch_size=2)


def _emit(root, model: str, name: str, cfg: dict, *, global_batch: int = 8, micro_batch: int = 2, **kw):
    """tests.parallel_cases.emit_case, for Hugging Face GPT-2 too."""
    if model != "hf":
        return emit_case(root, model, name, cfg, global_batch=global_batch, micro_batch=micro_batch, **kw)
    config = planner.ParallelConfig(micro_batch_size=micro_batch, dtype="fp32", **cfg)
    plan = make_fixed_plan(_hf_graph(), planner.Cluster.preset("local", devices=config.num_devices), config,
                           global_batch)
    return emit(plan, HF[0], None, root / f"hf_{name}", model_kwargs=HF[1], graph=_hf_graph(), bucket_bytes=2048,
                **kw).path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("execution")


@pytest.fixture(scope="module")
def builds(root):
    out = {}
    for name, (model, cfg, ex, kw) in CASES.items():
        kw = dict(kw)
        if kw.pop("evaluation", False):
            kw["evaluation"] = EvalSpec(every=2, batches=1)
        out[name] = _emit(root, model, name, cfg, execution=ex, **kw)
    out["hf_t2_resumed"] = _emit(root, "hf", "t2_resumed", dict(tensor=2),
                                 execution=Execution(loss="chunked", vocab_multiple=64), optimizer=ADAMW)
    return out


@pytest.fixture(scope="module")
def runs(builds, root):
    names = list(CASES)
    extra = [["--checkpoint-dir", str(root / "ckpt"), "--save-every", "2"] if n == "hf_p2_checkpoint" else []
             for n in names]
    results = run_many([builds[n] for n in names], steps=2, timeout=300, verify=True, build_args=extra)
    return dict(zip(names, results))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_option_on_equals_the_single_process_run(runs, name):
    assert_exact(runs[name], name)


def test_nothing_recompiles_after_the_first_step(runs, builds):
    for name, (_m, _c, ex, _kw) in CASES.items():
        if not ex.compiles:
            continue
        for rank in (0, 1):
            graphs = json.loads((builds[name] / "run" / f"rank_{rank:04d}.json").read_text())["compiled_graphs"]
            assert len(graphs) == 2 and graphs[0] > 0, f"{name} rank {rank}: {graphs}"
            assert graphs[1] == graphs[0], f"{name} rank {rank}: torch.compile made graphs after step 0 {graphs}"


def test_generated_code_compiles_one_method_per_repeated_block(builds):
    text = (builds["gpt_d2_zero3"] / "rank_0000.py").read_text()
    assert text.count("self.layer_blocks_0(getattr(self.blocks, ") == 2, "both blocks call one method"
    assert "def layer_blocks_1" not in text
    spec = read_build(builds["gpt_d2_zero3"])["stages"]["0"]
    assert "layer_blocks_0" in spec["compiled"] and spec["head"]["fused"] and spec["padded"]
    assert read_build(builds["gpt_d2_whole_stage"])["stages"]["0"]["compiled"] == ["forward"]


def test_padded_vocabulary_stays_out_of_checkpoints_and_resumes_in_another_padding(runs, builds, root, tmp_path):
    """hf p2 (the tied 1001-row weight padded to 1024 rows on each stage) saved after step 2: converted, the
    model's own state_dict (1001 rows); resumed on tensor 2 (each rank's 501 rows padded to 512), step 2 is
    the single-process run's."""
    ckpt = step_dir(root / "ckpt", 2)
    to_state_dict(ckpt, tmp_path / "model.pt")
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    spec = TrainSpec.from_dict(read_build(builds["hf_p2_checkpoint"])["train"])
    model = build_model(spec)
    model.load_state_dict(sd, strict=True)
    assert sd["lm_head.weight"].shape[0] == 1001 == model.config.vocab_size
    held = saved_params(builds["hf_p2_checkpoint"])   # after step 3, padded as the ranks hold them
    assert held[1]["lm_head.weight"].shape[0] == 1024 and held[1]["lm_head.weight"][1001:].abs().sum() == 0
    [res] = run_many([builds["hf_t2_resumed"]], steps=1, timeout=120, extra_args=["--save-params", "--save-steps"],
                     build_args=[["--resume", str(ckpt)]])
    assert res.returncode == 0, res.output[-3000:]
    cmp = verify_build(builds["hf_t2_resumed"], 1, res.losses, first_step=2)
    assert cmp.ok and cmp.params_compared > 0, cmp.summary()


def test_meshplan_checkpoint_convert_command(runs, root, tmp_path):
    from planner.app.cli import main

    assert main(["checkpoint", "convert", str(root / "ckpt"), "-o", str(tmp_path / "m.pt")]) == 0
    sd = torch.load(tmp_path / "m.pt", weights_only=True)
    assert tuple(sd["transformer.wte.weight"].shape) == (1001, 64)
