"""What torch.autocast does to a captured graph on a GPU (cost_models/autocast.py, cost_models/gpu_node.py) and
the memory meshplan's runtime allocates under it (planner/saved.py, cost_models/memory.py), by hand."""

from __future__ import annotations

import pytest
import torch

import planner
from cost_models.autocast import FLOAT32, LOW, cast_work, run_dtypes
from cost_models.gpu_costs import gpu_costs
from cost_models.gpu_node import GpuGraph
from cost_models.hardware import Cluster
from cost_models.memory import autocast_param_bytes
from cost_models.overlap import Overlap
from examples.models import gpt, hf
from planner import ParallelConfig
from planner.evaluator import Evaluator

B, T, C, V = 2, 64, 32, 128
SHAPE = dict(vocab_size=V, seq_len=T, hidden=C, num_layers=2, num_heads=4)
H100 = Cluster.preset("dgx-h100", devices=1)


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        model = gpt.build(**SHAPE)
    return planner.capture(model, gpt.example_inputs(batch_size=B, device="meta", **SHAPE))


def _node(graph, name):
    return next(n for n in graph.nodes if n.name == name)


def test_the_residual_stream_runs_in_fp32_and_the_gemms_in_16_bits(graph):
    d = run_dtypes(graph.nodes, autocast=True)
    # the fp32 embedding starts an fp32 residual stream; each branch's projection output is 16-bit and
    # the residual add promotes it back; LayerNorm runs in fp32 whatever its input
    assert d["wte"] == d["add"] == d["add_1"] == d["add_2"] == FLOAT32
    assert d["blocks_0_ln1"] == d["blocks_0_ln2"] == d["ln_f"] == FLOAT32
    assert d["blocks_0_attn_qkv"] == d["scaled_dot_product_attention"] == d["blocks_0_mlp_fc"] == LOW
    assert d["blocks_0_mlp_act"] == LOW and d["lm_head"] == LOW          # GELU keeps its input's dtype
    assert d["idx"] == "int64"
    # without autocast (a 16-bit stack) every float value is 16-bit
    floats = {k for k, v in d.items() if v in (FLOAT32, LOW)}
    assert {run_dtypes(graph.nodes, autocast=False)[k] for k in floats} == {LOW}


def test_a_linear_casts_its_fp32_input_and_its_weight_both_ways(graph):
    d = run_dtypes(graph.nodes, autocast=True)
    by = {n.name: n for n in graph.nodes}
    qkv = by["blocks_0_attn_qkv"]          # reads ln1's fp32 output (B, T, C); weight (3C, C) + bias 3C
    cw = cast_work(qkv, d, by, 2)
    x, w = B * T * C, 3 * C * C + 3 * C
    assert cw.fwd_bytes == 6 * x + 6 * w and cw.bwd_bytes == 6 * x + 6 * w
    assert cw.fwd_kernels == 2 and cw.bwd_kernels == 2 and cw.weight_copy_bytes == 2 * w
    # the projection reads a 16-bit value: only its weight is cast
    proj = by["blocks_0_attn_proj"]
    assert cast_work(proj, d, by, 2).fwd_bytes == 6 * (C * C + C)
    # the residual add reads the 16-bit branch: its gradient is cast down for it in backward (fp32 -> 16 bit)
    add = cast_work(by["add_1"], d, by, 2)
    assert add.fwd_bytes == 0 and add.bwd_bytes == 6 * B * T * C and add.bwd_kernels == 1


def test_hugging_face_gpt2_s_gelu_runs_in_fp32_after_its_pow():
    model = hf.build(arch="gpt2", preset="tiny")
    g = planner.capture(model, hf.example_inputs(arch="gpt2", preset="tiny", batch_size=2))
    d = run_dtypes(g.nodes, autocast=True)
    pows = [n for n in g.nodes if n.target == "aten.pow"]
    tanhs = [n for n in g.nodes if n.target == "aten.tanh"]
    assert pows and tanhs
    # gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): pow is an fp32 op under autocast, so the
    # chain after it (mul, add, tanh) runs in fp32 on a 16-bit matmul output
    assert all(d[n.name] == FLOAT32 for n in pows + tanhs)


def test_a_rank_holds_fp32_weights_and_gradients_and_a_16_bit_copy_per_micro_batch(graph):
    ev = Evaluator(graph, H100)
    pred = ev.evaluate(ParallelConfig(micro_batch_size=1, dtype="bf16"), 2)   # 2 micro-batches, 1F1B: 1 live
    params = graph.num_params
    m = pred.memory
    assert (m.parameters, m.gradients, m.optimizer) == pytest.approx((4 * params, 4 * params, 8 * params))
    # the weights autocast casts: every Linear (the embeddings are read in fp32)
    linears = sum(n.param_count for n in graph.nodes if n.kind == "linear")
    assert m.weight_copies == pytest.approx(2 * linears)
    # ZeRO in meshplan's runtime: whole gradients plus the reduced shard, optimizer state sharded
    pb = autocast_param_bytes(2, 4)
    assert (pb.weights, pb.gradients, pb.optimizer) == (4.0, 5.0, 2.0)
    assert autocast_param_bytes(3, 4).weights == 1.0


def test_the_fp32_residual_is_kept_4_bytes_and_a_linear_keeps_its_16_bit_copy(graph):
    block = next(layer for layer in graph.layers if layer.name == "blocks.0")
    config = ParallelConfig(micro_batch_size=B, dtype="bf16")
    auto = Evaluator(graph, H100).layer_cost(block, config).saved
    sixteen = Evaluator(graph, H100, overlap=Overlap.preset("megatron")).layer_cost(block, config).saved
    sbh = B * T * C
    # the two LayerNorm inputs (the residual stream) are fp32: 2 x 2 more bytes an element; the linears
    # reading a norm's output keep a 16-bit copy of it, as the 16-bit stack keeps the norm output itself
    assert auto - sixteen == pytest.approx(2 * 2 * sbh)


def test_a_slice_of_a_fused_qkv_pays_eager_autograd_s_zero_filled_gradient(graph):
    gg = GpuGraph(graph.nodes, autocast=True)
    gpu = Evaluator(graph, H100).gpu("bf16")
    q = _node(graph, "getitem")              # qkv (3, B, H, T, D)[0]
    x = gg.extras(q, gpu, share=1.0, div=1.0, low_bytes=2)
    whole, part = 3 * B * T * C, B * T * C
    c = gpu_costs(H100)
    expected = ((whole + 2 * part) * 2) / (3.35e12 * c.stream_efficiency) + 2 * c.kernel_gap + \
        (3 * whole * 2) / (3.35e12 * c.stream_efficiency) + c.kernel_gap
    assert x.backward == pytest.approx(expected)
    assert gg.extras(q, gpu, share=1.0, div=1.0, low_bytes=2, compiled=True).backward == 0.0
