"""A plan binds to the model, not to how it was captured (planner/graph/export.py: meta_twin;
planner/binding.py).

The Python path a new user takes: build a Hugging Face model on the CPU, `planner.make_plan(model, ...,
example_inputs=...)`, then `codegen.emit(plan, "examples/models/hf.py:build", ...)`, which captures the
same factory on meta. transformers' `.contiguous()` after attention traced to a different graph on
the CPU than on meta (the kernels report other strides), so every such plan was refused as "made for
another model". The six architectures of the issue, tiny, planned from CPU instances under pipeline 2
(the stages name layers), emit; a plan for another model is still refused,
naming what differs. (tests/distributed/test_plan_binding_runs.py runs a subset with --verify.)
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import planner
from codegen.emit import PlanMismatchError, emit
from codegen.partition import PartitionError, partition
from codegen.torch_target.script import emit_torch
from examples.models import hf
from planner.binding import graph_mismatch
from planner.graph.capture import capture_ref

HF = "examples/models/hf.py:build"
ARCHS = ("gpt2", "llama", "qwen2", "mistral", "bert", "vit")
CONFIG = planner.ParallelConfig(pipeline=2, micro_batch_size=2, dtype="fp32")


def cpu_plan(arch: str, config=CONFIG, target=None, **overrides):
    """The plan of the model built on the CPU, captured as it is (the README's Python path)."""
    torch.manual_seed(0)
    model = hf.build(arch, **overrides)
    assert all(not p.is_meta for p in model.parameters())
    cluster = planner.Cluster.preset("dgx-a100-80gb", devices=config.num_devices)   # fixed figures: nothing measured
    return planner.make_plan(model, cluster, config, global_batch_size=4, target=target,
                             example_inputs=hf.example_inputs(2, "cpu", arch, **overrides))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_plan_made_from_a_cpu_instance_emits_for_the_factory(arch, tmp_path):
    plan = cpu_plan(arch)
    assert plan.graph_params == sum(p.numel() for p in hf.build(arch).parameters())
    build = emit(plan, HF, None, tmp_path / arch, model_kwargs={"arch": arch})   # captures the factory on meta
    assert build.world_size == 2 and (tmp_path / arch / "rank_0001.py").is_file()


def test_the_torch_target_binds_the_same_way(tmp_path):
    plan = cpu_plan("llama", planner.ParallelConfig(tensor=2, micro_batch_size=2, dtype="fp32"), target="torch")
    build = emit_torch(plan, HF, None, tmp_path / "torch", model_kwargs={"arch": "llama"})
    assert build.script.is_file()


def test_a_plan_for_another_model_is_refused_naming_what_differs(tmp_path):
    plan = cpu_plan("llama")
    with pytest.raises(PlanMismatchError, match=r"the plan is for transformers\.\S+LlamaForCausalLM, this model is "
                                                r"transformers\.\S+Qwen2ForCausalLM"):
        emit(plan, HF, None, tmp_path / "qwen2", model_kwargs={"arch": "qwen2"})
    assert not (tmp_path / "qwen2").exists()
    deeper = capture_ref(HF, {"arch": "llama", "num_hidden_layers": 3}, batch_size=2)
    text = graph_mismatch(plan, deeper)
    assert re.search(r"the plan's model has 202,048 parameters, this one 239,040; the plan's stages hold 7 layers, "
                     r"this model has 8; layer \d is model\.norm in the plan and model\.layers\.2 here", text), text
    with pytest.raises(PartitionError, match="the plan was made for another model"):
        partition(plan, deeper)


def test_a_graph_that_differs_only_between_the_layers_is_named_so():
    graph = capture_ref("examples/models/mlp.py:build", {}, batch_size=2)
    plan = planner.make_plan(graph, planner.Cluster.preset("dgx-h100", devices=1),
                             planner.ParallelConfig(micro_batch_size=2, dtype="fp32"), global_batch_size=2)
    assert graph_mismatch(plan, graph) is None
    other = dataclasses.replace(graph, fingerprint="f" * 64)    # same class, parameters and layers
    assert "the same class, parameter count and layers, but other operations between them" in \
        graph_mismatch(plan, other)
