"""torch_layout: the torch styles, mesh and wrappers derived from plans of the example GPT, a Hugging
Face Llama and BERT (tests/real_models.py builds them), checked by module path against the splits
the planner makes for these tiny models (hand-read from their configurations)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import planner
from codegen.strategies.tensor.torch_styles import _style
from codegen.torch_target.layout import (DataKind, DataLayout, MeshDim, ModuleStyle, TensorStyle, TorchLayout,
                                         TorchLayoutError, torch_layout)
from planner.app.commands import make_fixed_plan
from runtime.parallel.tensor.layers import FeatureSplit
from runtime.vocab import MeshAxis, RecomputeMode, ShardRole
from tests.real_models import HF, graph_of

GPT = "examples/models/gpt.py:build"
C, R, E, O = TensorStyle.COLWISE, TensorStyle.ROWWISE, TensorStyle.EMBEDDING_ROWWISE, TensorStyle.OUTPUT_COLWISE
SEQ = TensorStyle.SEQUENCE


def _layout(ref: str, kwargs: dict, **cfg) -> TorchLayout:
    graph = graph_of(ref, tuple(sorted(kwargs.items())))
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=config.num_devices), config, 8)
    return torch_layout(plan, graph)


def _styles(layout: TorchLayout) -> dict[str, tuple]:
    return {s.path: (s.style, s.groups, s.dim) for s in layout.tensor}


def test_gpt_tensor_styles_strided_qkv():
    lay = _layout(GPT, {}, tensor=2)
    assert lay.mesh == (MeshDim(MeshAxis.TENSOR, 2),)
    assert lay.data == DataLayout(DataKind.NONE) and lay.sequence_dim is None
    block = {"attn.qkv": (TensorStyle.COLWISE_STRIDED, 3, None), "attn.proj": (R, 1, None),
             "mlp.fc": (C, 1, None), "mlp.proj": (R, 1, None)}
    want = {"wte": (E, 1, None), **{f"blocks.{i}.{k}": v for i in (0, 1) for k, v in block.items()},
            "lm_head": (O, 1, None)}
    assert _styles(lay) == want


def test_gpt_sequence_parallel_adds_norms_and_position_scatter():
    lay = _layout(GPT, {}, tensor=2, sequence_parallel=True)
    assert lay.sequence_dim == 1
    styles = _styles(lay)
    for path in ("blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"):
        assert styles[path] == (SEQ, 1, None)
    # wpe's (T, C) table meets the split activation: cut along its dimension 0
    assert styles["wpe"] == (TensorStyle.SEQUENCE_SCATTER, 1, 0)
    # every column gathers the sequence at its input, every row (and the embedding) scatters it
    assert styles["blocks.1.attn.qkv"] == (TensorStyle.COLWISE_STRIDED, 3, 1)
    assert styles["blocks.1.attn.proj"] == (R, 1, 1) and styles["wte"] == (E, 1, 1)
    assert styles["lm_head"] == (O, 1, 1)


@pytest.mark.parametrize("zero, kind, reshard", [(0, DataKind.REPLICATE, True), (1, DataKind.FULLY_SHARD, False),
                                                 (2, DataKind.FULLY_SHARD, False), (3, DataKind.FULLY_SHARD, True)])
def test_gpt_data_wrappers_by_zero_stage(zero, kind, reshard):
    lay = _layout(GPT, {}, data=2, zero=zero)
    assert lay.mesh == (MeshDim(MeshAxis.DATA, 2),) and lay.tensor == ()
    units = () if zero == 0 else ("blocks.0", "blocks.1")
    assert lay.data == DataLayout(kind, reshard, units)


def test_gpt_data_by_tensor_mesh_order_and_recompute():
    lay = _layout(GPT, {}, data=2, tensor=2, recompute="full")
    assert lay.mesh == (MeshDim(MeshAxis.DATA, 2), MeshDim(MeshAxis.TENSOR, 2))   # tensor innermost
    assert lay.world_size == 4
    assert lay.data.kind is DataKind.REPLICATE
    assert lay.recompute is RecomputeMode.FULL and lay.checkpoint_units == ("blocks.0", "blocks.1")
    assert lay.style_of("blocks.0.mlp.fc") == ModuleStyle("blocks.0.mlp.fc", C)


def test_llama_styles_by_module_path():
    lay = _layout(HF, {"arch": "llama"}, tensor=2)
    block = {"self_attn.q_proj": C, "self_attn.k_proj": C, "self_attn.v_proj": C, "self_attn.o_proj": R,
             "mlp.gate_proj": C, "mlp.up_proj": C, "mlp.down_proj": R}
    want = {"model.embed_tokens": E, **{f"model.layers.{i}.{k}": v for i in (0, 1) for k, v in block.items()},
            "lm_head": O}
    assert {p: s for p, (s, _, _) in _styles(lay).items()} == want
    assert lay.ties == ()


def test_llama_sequence_parallel_and_zero3_blocks():
    lay = _layout(HF, {"arch": "llama"}, tensor=2, sequence_parallel=True)
    styles = _styles(lay)
    for i in (0, 1):
        assert styles[f"model.layers.{i}.input_layernorm"] == (SEQ, 1, None)
        assert styles[f"model.layers.{i}.post_attention_layernorm"] == (SEQ, 1, None)
    assert styles["model.norm"] == (SEQ, 1, None)
    zero3 = _layout(HF, {"arch": "llama"}, data=2, zero=3)
    assert zero3.data.units == ("model.layers.0", "model.layers.1")


def test_bert_tied_decoder_and_embedding_share_the_vocabulary_split():
    lay = _layout(HF, {"arch": "bert"}, tensor=2)
    styles = {p: s for p, (s, _, _) in _styles(lay).items()}
    layer = {"attention.self.query": C, "attention.self.key": C, "attention.self.value": C,
             "attention.output.dense": R, "intermediate.dense": C, "output.dense": R}
    want = {"bert.embeddings.word_embeddings": E,
            **{f"bert.encoder.layer.{i}.{k}": v for i in (0, 1) for k, v in layer.items()},
            "cls.predictions.decoder": O}
    assert styles == want
    assert ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight") in lay.ties


def test_bert_blocks_are_the_encoder_layers_not_its_repeated_norms():
    lay = _layout(HF, {"arch": "bert"}, data=2, zero=3, recompute="full")
    assert lay.data.units == ("bert.encoder.layer.0", "bert.encoder.layer.1")
    assert lay.checkpoint_units == lay.data.units


def test_bert_sequence_parallel_scatters_and_gathers():
    lay = _layout(HF, {"arch": "bert"}, data=2, tensor=2, sequence_parallel=True)
    styles = _styles(lay)
    assert styles["bert.embeddings.token_type_embeddings"] == (TensorStyle.SEQUENCE_SCATTER, 1, 1)
    assert styles["bert.embeddings.position_embeddings"] == (TensorStyle.SEQUENCE_SCATTER, 1, 1)
    assert styles["cls.predictions.transform.dense"] == (TensorStyle.SEQUENCE_GATHER, 1, 1)
    # the head gathered the sequence, so the decoder's input is whole
    assert styles["cls.predictions.decoder"] == (O, 1, None)
    assert styles["bert.encoder.layer.0.attention.self.query"] == (C, 1, 1)
    assert styles["bert.encoder.layer.1.output.LayerNorm"] == (SEQ, 1, None)
    assert styles["bert.embeddings.LayerNorm"] == (SEQ, 1, None)


def test_round_trip_through_json():
    lay = _layout(HF, {"arch": "llama"}, data=2, tensor=2, zero=3, recompute="selective", sequence_parallel=True)
    back = TorchLayout.from_dict(json.loads(json.dumps(lay.to_dict())))
    assert back == lay and lay.data.kind is DataKind.FULLY_SHARD and lay.sequence_dim == 1
    strided = _layout(GPT, {}, tensor=2, sequence_parallel=True)
    assert TorchLayout.from_dict(json.loads(json.dumps(strided.to_dict()))) == strided
    assert isinstance(back.tensor[0].style, TensorStyle) and isinstance(back.recompute, RecomputeMode)


def test_refusals_name_the_thing():
    graph = graph_of(GPT, ())
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", data=2, pipeline=2)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=4), config, 8)
    other = graph_of(HF, (("arch", "llama"),))
    with pytest.raises(TorchLayoutError, match=r"made for another model: the plan is for examples\.models\.gpt\.GPT, this model is .*LlamaForCausalLM"):
        torch_layout(plan, other)
    with pytest.raises(TorchLayoutError, match="'blocks.0.attn.qkv'.* fully_shard"):
        _layout(GPT, {}, data=2, tensor=2, zero=3)
    # a row split that is not one block per rank (q_r, k_r, v_r of a fused input) has no torch style
    with pytest.raises(TorchLayoutError, match="'blocks.0.attn.out'"):
        _style("blocks.0.attn.out", "linear", ShardRole.ROW, FeatureSplit((3, 4, 8), 1), 2)


def test_a_tensor_axis_that_splits_nothing_gets_no_styles():
    """The search may pick a tensor axis whose ranks replicate every op (a model too small to split
    profitably): the layout keeps the tensor dimension in the mesh and applies no style."""
    graph = graph_of(GPT, ())
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", data=2, tensor=2)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=4), config, 8)
    plain = dataclasses.replace(plan, shardings=(), tensor_splits=None)
    layout = torch_layout(plain, graph)
    assert layout.tensor == () and [(d.axis, d.size) for d in layout.mesh] == [(MeshAxis.DATA, 2), (MeshAxis.TENSOR, 2)]
    with pytest.raises(TorchLayoutError, match="version-1 plan file"):
        torch_layout(dataclasses.replace(plan, tensor_splits=None), graph)
