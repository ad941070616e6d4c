"""The torch target's pipeline layout (codegen/torch_target/pipeline.py) of the tiny example GPT
(2 blocks, width 32, 16 tokens, vocabulary 64), and its stage modules (runtime/torch_stack/pipeline.py)
built in one process: they hold the model's own parameters and, chained, compute the model."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import planner
from codegen.emit import capture_ref
from codegen.torch_target.layout import DataKind, DataLayout, MeshDim, TorchLayout, torch_layout
from codegen.torch_target.pipeline import PipelineLayout, PipelineLayoutError, pipeline_layout, stage_classes
from planner.app.commands import make_fixed_plan
from runtime.spec import Boundary
from runtime.torch_stack.pipeline import stage_module
from runtime.vocab import MeshAxis, Schedule

GPT = "examples/models/gpt.py:build"


@functools.lru_cache(maxsize=None)
def gpt_graph():
    return capture_ref(GPT, {}, batch_size=2)


def plan_of(batch: int = 8, **cfg) -> planner.Plan:
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
    return make_fixed_plan(gpt_graph(), planner.Cluster.preset("local", devices=config.num_devices), config, batch)


def layout_of(batch: int = 8, **cfg) -> PipelineLayout | None:
    return pipeline_layout(plan_of(batch, **cfg), gpt_graph())


def test_two_stages_at_a_given_boundary():
    lay = layout_of(pipeline=2, schedule="1f1b", stage_boundaries=("blocks.1",))
    assert (lay.schedule, lay.pipeline, lay.virtual_stages, lay.num_stages) == (Schedule.ONE_F_ONE_B, 2, 1, 2)
    assert lay.num_micro_batches == 4            # 8 samples / micro-batch 2
    assert lay.inputs == ("idx",)
    first, last = lay.stages
    assert (first.position, first.spec.layers) == (0, ("wte", "drop", "blocks.0"))
    assert (last.position, last.spec.layers) == (1, ("blocks.1", "ln_f", "lm_head"))
    # the token ids come from the data; the block's (micro-batch 2, 16 tokens, width 32) output crosses
    assert first.spec.inputs == (Boundary("idx", (2, 16), "int64", False, "data", 0, "idx"),)
    assert [(b.shape, b.dtype, b.requires_grad, b.source) for b in last.spec.inputs] == \
        [((2, 16, 32), "float32", True, "recv")]
    assert [b.name for b in first.spec.outputs] == [b.name for b in last.spec.inputs]
    assert (first.class_name, last.class_name) == ("PipeStage0", "PipeStage1")


def test_interleaved_places_chunk_k_at_k_mod_pipeline_and_round_trips():
    lay = layout_of(pipeline=2, schedule="interleaved", virtual_stages=2,
                    stage_boundaries=("drop", "blocks.1", "ln_f"))
    assert [s.position for s in lay.stages] == [0, 1, 0, 1]
    assert [s.index for s in lay.stages_at(1)] == [1, 3]
    assert [s.spec.layers for s in lay.stages] == [("wte",), ("drop", "blocks.0"), ("blocks.1",), ("ln_f", "lm_head")]
    assert PipelineLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay


def test_plans_without_a_pipeline_have_no_pipeline_layout():
    assert layout_of(data=2) is None


def test_the_torch_layout_of_a_pipeline_plan():
    plan = plan_of(data=2, pipeline=2, zero=3, recompute="full", schedule="1f1b", stage_boundaries=("blocks.1",))
    lay = torch_layout(plan, gpt_graph())
    # meshplan's rank order: pipeline outermost, data inside it
    assert lay.mesh == (MeshDim(MeshAxis.PIPELINE, 2), MeshDim(MeshAxis.DATA, 2))
    assert lay.pipeline == pipeline_layout(plan, gpt_graph())
    # the stage module is the one fully_shard unit; recomputation lives in the stage code
    assert lay.data == DataLayout(DataKind.FULLY_SHARD, reshard_after_forward=True, units=())
    assert lay.checkpoint_units == ()
    assert "checkpoint(self.layer_blocks_0" in lay.pipeline.stages[0].source
    assert TorchLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused():
    with pytest.raises(PipelineLayoutError, match="needs at least 2 micro-batches per step, the plan has 1"):
        layout_of(batch=2, pipeline=2, schedule="1f1b")


def test_pipeline_with_tensor_parallelism_is_refused():
    with pytest.raises(PipelineLayoutError, match="pipeline 2 with tensor 2"):
        layout_of(pipeline=2, tensor=2, schedule="1f1b")


def test_stage_modules_hold_the_models_tensors_and_chain_to_its_output():
    lay = layout_of(pipeline=2, schedule="1f1b", stage_boundaries=("blocks.1",))
    torch.manual_seed(0)
    from examples.models.gpt import build

    model = build()
    stages = [stage_module(stage_classes(lay, s.position)[s.index], s.spec, model) for s in lay.stages]
    qkv = model.blocks[1].attn.qkv.weight
    assert stages[1].get_parameter("blocks.1.attn.qkv.weight") is qkv
    first = {n for n, _ in model.named_parameters() if n.startswith(("wte.", "wpe.", "blocks.0."))}
    assert dict(stages[0].named_parameters()).keys() == first       # token and position tables, block 0
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    # torch's schedule hands the model's inputs by name to every stage, the previous outputs by position
    out = stages[1](*stages[0](idx=idx), idx=idx)
    assert torch.equal(out, model(idx))
    out.sum().backward()
    assert qkv.grad is not None          # the model's own parameter took the gradient
