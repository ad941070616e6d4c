"""The planner chooses the execution options (runtime/execution.py) that pay, on a GPU, for meshplan's
runtime (planner/execution_choice.py); elsewhere it keeps the defaults. Meta-tensor graphs, no GPU."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import planner
from cost_models.step_costs import StepSetup
from examples.models import gpt, resnet
from planner import ParallelConfig
from planner.app.cli import main
from planner.evaluator import Evaluator
from planner.execution_choice import VOCAB_MULTIPLE, candidates, choose
from runtime.execution import Execution, LossImpl

# the H100.md case (tests/planning/test_h100_case.py): a vocabulary of 50304 = 786 x 64, already aligned
H100_CASE = dict(vocab_size=50304, seq_len=1024, hidden=768, num_layers=12, num_heads=12)
ONE_H100 = planner.Cluster.preset("dgx-h100", devices=1)


def _gpt(batch: int, **kw):
    with torch.device("meta"):
        model = gpt.build(**kw)
    return planner.capture(model, gpt.example_inputs(batch_size=batch, device="meta", **kw))


@pytest.fixture(scope="module")
def h100_case():
    return _gpt(16, **H100_CASE)


def test_on_a_gpu_every_combination_is_priced_and_the_fastest_taken(h100_case):
    ev = Evaluator(h100_case, ONE_H100)
    cfg = ParallelConfig(micro_batch_size=16, dtype="bf16")
    options = candidates(ev, cfg)
    # compiled or eager; the full loss, the same compiled, or the fused chunked one; the vocabulary is
    # aligned: nothing to pad
    assert options[0] == Execution() and len(options) == 6
    assert {(e.compile, e.loss) for e in options} == {(c, lo) for c in (False, True) for lo in LossImpl}
    assert all(e.vocab_multiple == 1 for e in options)
    best_ev, best = choose(ev, cfg, 16)
    priced = {e: ev.with_execution(e).evaluate(cfg, 16) for e in options}
    assert best.step_time == min(p.step_time for p in priced.values())
    assert best == priced[best_ev.execution]
    # as measured on an H100 (cost_models/reference/README.md): compiled stages pay (48.96 ms against 60.05
    # eager), the fused chunked loss does not once they are compiled (53.00 ms): it runs the head's GEMMs
    # again in backward. The compiled loss (not yet measured on a GPU) reads the 16384 x 50304 bf16 logits
    # four times where the eager loss moves 48 bytes a logit: priced the fastest
    assert best_ev.execution == Execution(compile=True, loss=LossImpl.COMPILED)
    compiled_full = priced[Execution(compile=True)]
    compiled_chunked = priced[Execution(compile=True, loss=LossImpl.CHUNKED)]
    assert compiled_full.step_time < 0.9 * priced[Execution()].step_time
    assert best.step_time < 0.85 * compiled_full.step_time and best.step_time < compiled_chunked.step_time
    logits = 16 * 1024 * 50304
    # the loss terms themselves: 14.0 ms eager (measured 14 ms on the H100, H100.md) against ~3 compiled
    assert compiled_full.time.loss > 4 * best.time.loss
    # memory: the compiled loss keeps the bf16 logits (2 bytes each) where the eager one keeps fp32
    # log-probabilities and holds two more fp32 copies in backward; the fused loss never holds them
    assert best.allocated_memory < compiled_full.allocated_memory - 4 * logits
    assert compiled_chunked.allocated_memory < best.allocated_memory - logits


def test_the_compiled_loss_is_not_priced_where_the_logits_are_split_over_the_vocabulary(h100_case):
    two = planner.Cluster.preset("dgx-h100", devices=2)
    ev = Evaluator(h100_case, two)
    split = ParallelConfig(tensor=2, micro_batch_size=16, dtype="bf16")
    assert ev.split_divisor(ev.logits_node(), ev.node_roles(split).get(ev.logits_node()), split) > 1
    assert {e.loss for e in candidates(ev, split)} == {LossImpl.FULL, LossImpl.CHUNKED}
    whole = ParallelConfig(data=2, micro_batch_size=8, dtype="bf16")
    assert LossImpl.COMPILED in {e.loss for e in candidates(ev, whole)}


def test_a_misaligned_vocabulary_is_padded_to_a_multiple_of_64():
    graph = _gpt(8, vocab_size=50257, seq_len=256, hidden=256, num_layers=2, num_heads=4)
    ev = Evaluator(graph, ONE_H100)
    cfg = ParallelConfig(micro_batch_size=8, dtype="bf16")
    options = candidates(ev, cfg)
    assert {e.vocab_multiple for e in options} == {VOCAB_MULTIPLE}
    best_ev, _ = choose(ev, cfg, 8)
    assert best_ev.execution.vocab_multiple == VOCAB_MULTIPLE


def test_where_an_option_does_not_apply_only_the_defaults_are_priced(h100_case):
    cfg = ParallelConfig(micro_batch_size=16, dtype="bf16")
    # a CPU: its cost model does not price compilation
    cpu = Evaluator(h100_case, planner.Cluster.preset("local", devices=1))
    assert candidates(cpu, cfg) == [Execution()]
    # a loss other than cross-entropy: no fused chunked loss, compilation still priced
    mse = Evaluator(h100_case, ONE_H100, setup=StepSetup(loss="mse"))
    assert {e.loss for e in candidates(mse, cfg)} == {LossImpl.FULL}
    assert any(e.compile for e in candidates(mse, cfg))
    # strategies whose stages the runtime does not compile
    with torch.device("meta"):
        net = resnet.build(depth=20)
    graph = planner.capture(net, resnet.example_inputs(batch_size=4, device="meta"))
    spatial = Evaluator(graph, planner.Cluster.preset("dgx-h100", devices=2))
    assert candidates(spatial, ParallelConfig(spatial=2, spatial_until=graph.layers[1].name,
                                                         micro_batch_size=4)) == [Execution()]


def test_a_plan_that_fits_only_with_the_fused_loss_takes_it(h100_case):
    ev = Evaluator(h100_case, ONE_H100)
    cfg = ParallelConfig(micro_batch_size=16, dtype="bf16")
    full = ev.evaluate(cfg, 16)
    chunked = ev.with_execution(Execution(loss=LossImpl.CHUNKED)).evaluate(cfg, 16)
    compiled = [ev.with_execution(Execution(compile=c, loss=LossImpl.COMPILED)).evaluate(cfg, 16)
                for c in (False, True)]
    # the fused loss's peak lies below the compiled loss's, which lies below the full one's
    assert chunked.peak_memory < min(p.peak_memory for p in compiled) and max(p.peak_memory for p in compiled) \
        < full.peak_memory
    limit = (min(p.peak_memory for p in compiled) + chunked.peak_memory) / 2   # between the two
    best_ev, best = choose(ev, cfg, 16, fits=lambda pred: pred.peak_memory <= limit)
    assert best_ev.execution.chunked and best.peak_memory <= limit
    # nothing fits: the defaults, as priced
    none_ev, none = choose(ev, cfg, 16, fits=lambda pred: False)
    assert none_ev.execution == Execution() and none == full


def test_optimize_and_make_plan_record_the_choice_and_the_torch_target_keeps_the_defaults(h100_case):
    cfg = ParallelConfig(micro_batch_size=16, dtype="bf16")
    fixed = planner.make_plan(h100_case, ONE_H100, cfg, global_batch_size=16)
    assert fixed.execution == Execution(compile=True, loss=LossImpl.COMPILED)
    searched = planner.optimize(h100_case, ONE_H100, global_batch_size=16, progress=False)
    assert not searched.execution.is_default
    assert "execution: " in searched.summary()
    torch_plan = planner.optimize(h100_case, ONE_H100, global_batch_size=16, progress=False, target="torch")
    assert torch_plan.execution == Execution()


def _codegen_plan(tmp_path, name: str, *extra: str, memory_mib: int = 80 * 1024) -> dict:
    """The plan.json `meshplan codegen` writes for a small GPT (MODEL_ARGS) on one H100 with `memory_mib`
    of memory."""
    out, cluster = tmp_path / name, tmp_path / f"h100-{memory_mib}.yaml"
    if not cluster.exists():
        h100 = planner.Cluster.preset("dgx-h100", devices=1)
        dataclasses.replace(h100, device=dataclasses.replace(h100.device, memory_bytes=memory_mib * 2**20)).save(cluster)
    argv = ["codegen", "examples/models/gpt.py:build", *MODEL_ARGS, "--cluster", str(cluster), "--batch", "8",
            "--micro-batch", "8", "--dtype", "bf16", "--optimizer", "adamw", "-o", str(out), *extra]
    assert main(argv) == 0
    return json.loads((out / "plan.json").read_text())


# predicted on one H100 at micro-batch 8: 224 MiB at its peak with the full loss, 124 with the compiled one, 130
# with the fused one
MODEL_ARGS = ("--arg", "vocab_size=8100", "--arg", "seq_len=256", "--arg", "hidden=64", "--arg", "num_layers=1",
              "--arg", "num_heads=2")


def test_codegen_of_a_fixed_configuration_prices_the_build_s_own_step(tmp_path, capsys):
    # a vocabulary of 8100 is not a multiple of 64: the plan pads it, and compiles the stage
    chosen = _codegen_plan(tmp_path, "chosen")
    assert chosen["execution"]["vocab_multiple"] == VOCAB_MULTIPLE and chosen["execution"]["compile"]
    # a flag given overrides the plan's field, the rest stays as chosen
    eager = _codegen_plan(tmp_path, "eager", "--no-compile")
    assert eager["execution"].get("compile", False) is False
    assert eager["execution"]["vocab_multiple"] == VOCAB_MULTIPLE
    # where the full loss does not fit, a cross-entropy build takes one that holds less (here the compiled
    # loss, 124 MiB at its peak, below even the fused one's 130: it keeps no fp32 weight-gradient
    # accumulator); an MSE build is never given either (its build would refuse them)
    tight = _codegen_plan(tmp_path, "tight", memory_mib=180)
    assert tight["execution"]["loss"] == "compiled"
    mse = _codegen_plan(tmp_path, "mse", "--loss", "mse", memory_mib=180)
    assert mse.get("execution", {}).get("loss", "full") == "full"
    capsys.readouterr()
    # on a CPU cluster the defaults, which a plan does not write
    cpu = tmp_path / "cpu"
    assert main(["codegen", "examples/models/gpt.py:build", *MODEL_ARGS, "--batch", "4", "-o", str(cpu)]) == 0
    assert "execution" not in json.loads((cpu / "plan.json").read_text())


def test_a_whole_stage_compiled_is_priced_compiled_layer_by_layer_with_its_gradient_sync_after_it():
    graph = _gpt(8, **dict(H100_CASE, num_layers=4))
    two = planner.Cluster.preset("dgx-h100", devices=2)
    ev = Evaluator(graph, two)
    blocks, stage = (ev.with_execution(Execution(compile=True, compile_scope=s)) for s in ("blocks", "stage"))
    cfg = ParallelConfig(micro_batch_size=4, dtype="bf16")
    # the layers regional compilation leaves eager (the embeddings, the final norm, the head) run compiled too
    eager_ones = [L for L in graph.layers if L.index not in ev._compiled_layers]
    assert eager_ones and all(stage.layer_cost(L, cfg).host_forward < blocks.layer_cost(L, cfg).host_forward
                              or stage.layer_cost(L, cfg).forward < blocks.layer_cost(L, cfg).forward
                              for L in eager_ones if L.param_count)
    block = next(L for L in graph.layers if L.index in ev._compiled_layers)
    assert stage.layer_cost(block, cfg) == blocks.layer_cost(block, cfg)
    # at data 2 the gradient sync starts only after the stage's one compiled backward: more of it exposed
    d2 = dataclasses.replace(cfg, data=2, micro_batch_size=4)
    assert stage.evaluate(d2, 8).time.data_comm > blocks.evaluate(d2, 8).time.data_comm
