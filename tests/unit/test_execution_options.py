"""Execution options (runtime/execution.py) from the plan and the codegen flags into the build: their
documents, the stage code they generate (one method per repeated block, the fused output layer, the
padded vocabulary), the padded splits, and the refusals that name why an option cannot run."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

import planner
from codegen.emit import ExecutionError, check_execution
from codegen.partition import PartitionError, partition
from codegen.train_flags import execution_of
from planner.app.cli import build_parser, main
from planner.app.commands import make_fixed_plan
from planner.plan import Plan
from runtime.checkpoint.restore import unshard
from runtime.execution import Execution
from runtime.reference import local_slice
from runtime.spec import StageSpec, TrainSpec
from runtime.parallel.tensor.layers import FeatureSplit, ShardError
from tests.parallel_cases import graph_of, plan_for

GPT = "examples/models/gpt.py:build"


def test_execution_names_its_options_and_round_trips():
    ex = Execution(compile=True, loss="chunked", loss_chunk_tokens=256, vocab_multiple=64, compile_backend="aot_eager")
    assert ex.options() == ["--compile", "--loss-impl chunked", "--loss-chunk-tokens 256", "--vocab-multiple 64",
                            "compile_backend aot_eager"]
    assert Execution.from_dict(ex.to_dict()) == ex and ex.chunked and not ex.is_default
    assert Execution().options() == [] and Execution.from_dict({}) == Execution()
    with pytest.raises(ValueError, match="compile_backend 'xla'"):
        Execution(compile_backend="xla")
    with pytest.raises(ValueError, match="compile_backend"):
        Execution.from_dict({"compile_backend": "xla"})


def test_compile_scope_is_written_only_when_asked_for_and_names_a_bad_value():
    stage = Execution(compile=True, compile_scope="stage")
    assert stage.whole_stage and stage.options() == ["--compile", "--compile-scope stage"]
    assert Execution.from_dict(stage.to_dict()) == stage and stage.to_dict()["compile_scope"] == "stage"
    assert "compile_scope" not in Execution(compile=True).to_dict()   # documents of the default read as before
    assert not Execution(compile_scope="stage").whole_stage   # a scope without compilation compiles nothing
    with pytest.raises(ValueError, match="compile_scope 'model' is not one of blocks, stage"):
        Execution(compile_scope="model")
    with pytest.raises(ValueError, match="compile_scope"):
        Execution.from_dict({"compile_scope": "model"})
    args = build_parser().parse_args(["codegen", GPT, "--batch", "4", "--compile-scope", "stage"])
    assert execution_of(args, Execution(compile=True)) == stage


def test_plan_and_build_write_execution_only_when_it_is_not_the_default():
    plan = plan_for("mlp")
    assert "execution" not in plan.to_dict() and Plan.from_dict(plan.to_dict()).execution == Execution()
    fast = dataclasses.replace(plan, execution=Execution(compile=True, vocab_multiple=64))
    assert fast.to_dict()["execution"]["vocab_multiple"] == 64
    assert Plan.from_dict(fast.to_dict()) == fast
    assert "execution: --compile --vocab-multiple 64" in fast.summary()
    spec = TrainSpec("m.py:build", "m.py:batch", 8, execution=Execution(loss="chunked"))
    assert TrainSpec.from_dict(spec.to_dict()) == spec
    old = {k: v for k, v in spec.to_dict().items() if k != "execution"}   # a build made before the option
    assert TrainSpec.from_dict(old).execution == Execution()


def test_codegen_flags_override_the_plans_execution_field_by_field():
    planned = Execution(compile=True, loss_chunk_tokens=7)
    args = build_parser().parse_args(["codegen", GPT, "--batch", "4", "--no-compile", "--loss-impl", "chunked",
                                      "--vocab-multiple", "64"])
    assert execution_of(args, planned) == Execution(compile=False, loss="chunked", loss_chunk_tokens=7,
                                                    vocab_multiple=64)
    assert execution_of(build_parser().parse_args(["codegen", GPT, "--batch", "4"]), planned) == planned


def test_a_padded_split_holds_aligned_blocks_and_drops_the_padding_when_whole():
    fs = FeatureSplit((50257,), 0, 64)
    assert fs.local_size(1) == 50304 and fs.local_size(2) == 25152 and fs.padded(1) and fs.padded(2)
    assert FeatureSplit.from_list(fs.to_list()) == fs and FeatureSplit((8,), 0).to_list() == [[8], 0]
    assert fs.indices(1, 2).tolist() == list(range(25152, 50257)) and fs.contiguous_start(1, 2) == 25152
    with pytest.raises(ShardError, match="multiple"):
        FeatureSplit((3, 4), 1, 2)
    full = torch.randn(50257, 3)
    one = local_slice(full, (0, fs), 0, 1)   # one rank: the whole table, padded
    assert one.shape == (50304, 3) and torch.equal(one[:50257], full) and not one[50257:].any()
    assert torch.equal(unshard("w", {0: one}, (0, fs), 1), full)
    parts = {r: local_slice(full, (0, fs), r, 2) for r in range(2)}
    assert all(p.shape == (25152, 3) for p in parts.values()) and torch.equal(unshard("w", parts, (0, fs), 2), full)


def _partition(model: str, execution: Execution, **cfg):
    return partition(dataclasses.replace(plan_for(model, **cfg), execution=execution), graph_of(model))


def test_compiled_stages_share_one_method_per_repeated_block():
    [stage] = _partition("gpt", Execution(compile=True)).stages
    src = stage.source
    assert "def layer_blocks_0(self, layer, x):" in src and "def layer_blocks_1" not in src
    assert 'self.layer_blocks_0(getattr(self.blocks, "1"), ' in src
    assert stage.spec.compiled == ("layer_blocks_0",)   # the repeated block; the other layers stay eager
    mlp = _partition("mlp", Execution(compile=True)).stages[0].spec   # no repeated block: its Linears
    assert mlp.compiled == ("layer_net_0", "layer_net_2", "layer_net_4")
    assert StageSpec.from_dict(stage.spec.to_dict()) == stage.spec
    whole = _partition("gpt", Execution(compile=True, compile_scope="stage"), pipeline=2).stages
    assert [s.spec.compiled for s in whole] == [("forward",), ("forward",)]   # each stage's whole forward
    plain = _partition("gpt", Execution()).stages[0]
    assert "def layer_blocks_1(self, add_2):" in plain.source and not plain.spec.compiled
    assert "compiled" not in plain.spec.to_dict() and "head" not in plain.spec.to_dict()


def test_chunked_loss_returns_the_hidden_state_and_holds_the_output_layer():
    first, last = _partition("gpt", Execution(loss="chunked"), pipeline=2).stages
    assert "return ln_f" in last.source and "self.lm_head(" not in last.source
    assert "lm_head" in last.spec.modules and last.spec.head.fused and last.spec.head.weight == "lm_head.weight"
    assert first.spec.head is None and last.spec.head.vocab == 128
    assert any(name == "lm_head.weight" for name, _, _ in last.params)


def test_padded_vocabulary_at_one_rank_narrows_the_logits_back():
    [stage] = _partition("gpt", Execution(vocab_multiple=48)).stages
    assert "torch.narrow(lm_head, -1, 0, 128)" in stage.source
    assert [(p.name, p.split.local_size(1)) for p in stage.spec.padded] == [("lm_head.weight", 144)]
    assert dict((n, s) for n, s, _ in stage.params)["lm_head.weight"] == (144, 32)
    assert stage.spec.split_of("lm_head.weight", 2)[1].local_size(1) == 144
    t2 = _partition("gpt", Execution(vocab_multiple=48), tensor=2).stages[0]   # 64 rows a rank -> 96
    assert t2.spec.output_split.local_size(2) == 96 and not t2.spec.padded


class _Softcapped(nn.Module):
    """Logits post-processed after the output layer (as Gemma's soft-capping): no head to fuse or pad."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, x):
        return torch.tanh(self.head(self.emb(x)) / 30.0) * 30.0


def test_options_the_model_or_the_setup_cannot_run_are_refused_with_the_reason():
    graph = planner.capture(_Softcapped(), (torch.zeros(2, 4, dtype=torch.long),))
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=1),
                           planner.ParallelConfig(micro_batch_size=2), 2)
    for ex, flag in ((Execution(loss="chunked"), "--loss-impl chunked"), (Execution(vocab_multiple=8), "--vocab")):
        with pytest.raises(PartitionError, match=f"{flag}.*post-processes"):
            partition(dataclasses.replace(plan, execution=ex), graph)
    mlp = plan_for("mlp")
    with pytest.raises(ExecutionError, match="loss is mse: use --loss-impl full"):
        check_execution(mlp, Execution(loss="chunked"), "mse")
    spatial = types.SimpleNamespace(config=planner.ParallelConfig(spatial=2, spatial_until="conv"), subgraph=())
    with pytest.raises(ExecutionError, match="--compile does not run with spatial parallelism"):
        check_execution(spatial, Execution(compile=True), "cross_entropy")
    recomputed = plan_for("gpt", recompute="full")
    with pytest.raises(ExecutionError, match="--compile-scope stage does not run with recompute full"):
        check_execution(recomputed, Execution(compile=True, compile_scope="stage"), "cross_entropy")
    check_execution(recomputed, Execution(compile=True), "cross_entropy")   # regional compilation does


def test_the_torch_target_refuses_execution_options_naming_them(tmp_path, capsys):
    assert main(["codegen", GPT, "--arg", "preset=tiny", "--batch", "4", "--target", "torch", "--compile",
                 "--vocab-multiple", "64", "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "does not run --compile, --vocab-multiple 64" in err and "Traceback" not in err
