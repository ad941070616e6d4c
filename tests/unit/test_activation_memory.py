"""Activation memory per op (cost_models/activations.py, planner/saved.py) against Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4, eq. 1-5).

One block of the example GPT, captured on meta at s = 64 tokens, b = 2 sequences, h = 32,
a = 4 heads, dropout 0.1, priced in bf16 (2-byte activations). Per layer the paper counts

    no parallelism      s b h (34 + 5 a s / h)
    tensor t            s b h (10 + 24/t + 5 a s / (h t))
    tensor t + SP       s b h (34 + 5 a s / h) / t
    selective           the same without the 5 a s / h term
    full                the layer input, 2 s b h (/t with SP)

to which the model adds what the paper leaves out: the two LayerNorms' fp32 mean and
reciprocal standard deviation, 2 x 2 x 4 bytes per token = 16 s b (whole on every tensor
rank; /t with SP). Fused (flash) attention keeps no probabilities: in place of 5 a s^2 b it keeps
its fp32 log-sum-exp, 4 a s b bytes (split over t), which selective recomputation drops.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import planner
from cost_models.activations import OpView, SavedTensor, SelectivePolicy, TensorRef, Width, layer_bytes, saved_by
from cost_models.hardware import Cluster
from cost_models.memory import ALLOCATOR_MARGIN, param_bytes
from cost_models.overlap import Overlap
from examples.models import gpt
from planner import ParallelConfig
from planner.evaluator import Evaluator

S, B, H, A = 64, 2, 32, 4
SBH, SB = S * B * H, S * B
SHAPE = dict(vocab_size=128, seq_len=S, hidden=H, num_layers=2, num_heads=A, dropout=0.1)
A100 = Cluster.preset("dgx-a100-80gb")


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        model = gpt.build(**SHAPE)
    return planner.capture(model, gpt.example_inputs(batch_size=B, device="meta", **SHAPE))


def _block(graph):
    return next(layer for layer in graph.layers if layer.name == "blocks.0")


def _cost(graph, t, recompute, sp=False, fused=False):
    # the paper counts Megatron-LM's layer: 16-bit weights and activations, no autocast (cost_models/autocast.py)
    ev = Evaluator(graph, A100, fused_attention=fused, sharding="all", overlap=Overlap.preset("megatron-2021"))
    config = ParallelConfig(data=8 // t, tensor=t, micro_batch_size=B, dtype="bf16", recompute=recompute,
                            sequence_parallel=sp)
    return ev, config, ev.layer_cost(_block(graph), config)


def _paper(t, recompute, sp):
    """Korthikanti et al. eq. 1-5 plus the LayerNorm statistics (module docstring), bytes."""
    core = 5 * A * S / H / t
    if recompute == "full":
        return 2 * SBH / (t if sp else 1)
    rest = SBH * (34 / t if sp else 10 + 24 / t) + 16 * SB / (t if sp else 1)
    return rest + (SBH * core if recompute == "none" else 0.0)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])  # SP needs t >= 2
def test_gpt_block_saves_what_the_paper_counts(graph, t, recompute, sp):
    _ev, _config, cost = _cost(graph, t, recompute, sp)
    assert cost.saved == pytest.approx(_paper(t, recompute, sp))


@pytest.mark.parametrize("t", [1, 2, 4])
def test_selective_recomputes_the_attention_core_and_nothing_else(graph, t):
    ev, config, cost = _cost(graph, t, "selective")
    # the dropped 5 a s^2 b / t is live again while the layer's backward runs
    assert cost.working == pytest.approx(SBH * 5 * A * S / H / t)
    # exactly the attention op's forward runs again (the block's one scaled_dot_product_attention)
    roles = ev.layer_roles(_block(graph), config)
    attn = next(ev.node(n) for n in _block(graph).nodes if ev.node(n).kind == "attention")
    assert cost.recompute == pytest.approx(ev.node_cost(attn, roles.get(attn.name, "replicate"), config).fwd)
    assert cost.recompute > 0


def test_full_recompute_keeps_the_input_and_rebuilds_the_whole_layer(graph):
    _ev, _config, none = _cost(graph, 2, "none")
    _ev, _config, full = _cost(graph, 2, "full")
    assert full.saved == pytest.approx(2 * SBH)
    assert full.working == pytest.approx(none.saved)
    assert full.recompute == pytest.approx(none.forward)


@pytest.mark.parametrize("t", [1, 2])
def test_flash_attention_keeps_the_log_sum_exp_instead_of_the_probabilities(graph, t):
    lse = 4 * A * S * B / t
    _ev, _config, none = _cost(graph, t, "none", fused=True)
    assert none.saved == pytest.approx(_paper(t, "selective", False) + lse)
    _ev, _config, sel = _cost(graph, t, "selective", fused=True)
    assert sel.saved == pytest.approx(_paper(t, "selective", False))
    assert sel.working == pytest.approx(lse)


def test_a_tensor_kept_by_two_ops_counts_once_and_stays_if_either_keeps_it():
    x = TensorRef("x", (4, 8), "float32")
    kept = SavedTensor("x", 32, Width.ACTIVATION)
    core = dataclasses.replace(kept, core=True)
    assert layer_bytes([kept, core], compute_bytes=2).total == 64
    assert layer_bytes([kept, core], compute_bytes=2, selective=True).core == 0
    assert layer_bytes([core, core], compute_bytes=2, selective=True).core == 64
    # a product of two activations keeps both, a product with a constant nothing, with a weight the input
    y = TensorRef("y", (4, 8), "float32")
    assert [s.key for s in saved_by(OpView("m", "elementwise", "mul", (x, y), x))] == ["x", "y"]
    assert saved_by(OpView("m", "elementwise", "mul", (x,), x)) == ()
    assert [s.key for s in saved_by(OpView("m", "elementwise", "mul", (x,), x, params=True))] == ["x"]
    # a dropout keeps a 1-byte mask only when it drops something
    assert saved_by(OpView("d", "elementwise", "dropout", (x,), x, dropout_p=0.0)) == ()
    (mask,) = saved_by(OpView("d", "elementwise", "dropout", (x,), x, dropout_p=0.1))
    assert mask.nbytes(compute_bytes=2) == 32


def test_sequence_parallel_divides_only_what_tensor_parallelism_leaves_whole():
    whole = SavedTensor("ln", 100, Width.ACTIVATION)
    split = SavedTensor("fc", 400, Width.ACTIVATION, split=4)
    assert whole.nbytes(2, sequence=4) == 50 and split.nbytes(2, sequence=4) == 200
    assert whole.nbytes(2) == 200


def test_gradients_held_in_fp32_and_the_allocator_margin(graph):
    assert param_bytes("bf16", 0, 1, grad_bytes=4).total == 2 + 4 + 12
    with pytest.raises(ValueError, match="gradient width"):
        param_bytes("bf16", 0, 1, grad_bytes=3)
    with pytest.raises(ValueError, match="allocator_margin"):
        Evaluator(graph, A100, allocator_margin=-0.1)
    config = ParallelConfig(data=8, dtype="bf16")
    pred = Evaluator(graph, A100).evaluate(config, global_batch_size=16)
    m = pred.memory
    allocated = m.total - m.fragmentation
    assert m.fragmentation == pytest.approx(ALLOCATOR_MARGIN * allocated)
    bare = Evaluator(graph, A100, allocator_margin=0.0).evaluate(config, global_batch_size=16)
    assert bare.memory.fragmentation == 0 and bare.peak_memory == pytest.approx(allocated)


def test_a_weight_read_through_get_attr_is_no_temporary_activation():
    class Functional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(256, 16))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.w)   # (B, 16) -> (B, 256)

    with torch.device("meta"):
        graph = planner.capture(Functional(), (torch.empty(4, 16),))
    ev = Evaluator(graph, A100)
    config = ParallelConfig(data=8, micro_batch_size=64, dtype="bf16")
    weight = next(n for n in graph.nodes if n.kind == "param")
    linear = next(n for n in graph.nodes if n.kind == "linear")
    assert ev.node_cost(weight, "replicate", config).temp == 0
    # the output (64, 256) in bf16 and its gradient
    assert ev.node_cost(linear, "replicate", config).temp == 2 * 64 * 256 * 2


def test_zero3_gathers_two_layers_or_the_stacks_live_parameter_bound(graph):
    config = ParallelConfig(data=8, zero=3, micro_batch_size=B, dtype="bf16")
    # the largest layer's parameters: a block, qkv h(3h) + 3h, proj h^2 + h, MLP h(4h) + 4h and (4h)h + h,
    # two LayerNorms 2h each: 12 h^2 + 13 h (the lm_head has h x vocabulary = 4096)
    largest = 12 * H * H + 13 * H
    weights = graph.num_params * 2 / 8
    # stacks that hold 16-bit weights (FSDP2 with a bf16 param_dtype, DeepSpeed); meshplan's own runtime
    # gathers a stage's fp32 weights whole (test_autocast_memory.py)
    fsdp = Evaluator(graph, A100, overlap=Overlap.preset("torchtitan")).evaluate(config, global_batch_size=8 * B).memory
    assert fsdp.parameters == pytest.approx(weights + 2 * largest * 2)   # current + prefetched layer, bf16
    deepspeed = Evaluator(graph, A100, zero3_live_parameters=1000, overlap=Overlap.preset("deepspeed")).evaluate(
        config, global_batch_size=8 * B).memory
    assert deepspeed.parameters == pytest.approx(weights + 1000 * 2)
    with pytest.raises(ValueError, match="zero3_live_parameters"):
        Evaluator(graph, A100, zero3_live_parameters=0)


def test_torchtitan_selective_keeps_the_input_the_attention_output_and_every_other_matmul(graph):
    # torchtitan's op-level policy on the example GPT block, flash attention, t = 1, bf16. The block's
    # linears in forward order: qkv (3h), projection (h), fc1 (4h), fc2 (h); the 1st and 3rd are kept,
    # with the block input (2 s b h), the attention output (2 s b h) and its log-sum-exp (4 a s b).
    ev = Evaluator(graph, A100, fused_attention=True, overlap=Overlap.preset("megatron-2021"),
                   selective=SelectivePolicy.ALTERNATE_MATMULS)
    config = ParallelConfig(data=8, micro_batch_size=B, dtype="bf16", recompute="selective")
    block = _block(graph)
    linears = [n for n in block.nodes if ev.node(n).kind == "linear"]
    assert [ev.node(n).output_meta[0].shape[-1] for n in linears] == [3 * H, H, 4 * H, H]
    cost = ev.layer_cost(block, config)
    assert cost.saved == pytest.approx(2 * SBH + 2 * 3 * SBH + 2 * 4 * SBH + 2 * SBH + 4 * A * S * B)
    none = ev.layer_cost(block, dataclasses.replace(config, recompute="none"))
    assert cost.working == pytest.approx(none.saved)
    # every forward runs again but the kept products' and the attention kernel's
    roles = ev.layer_roles(block, config)
    kept = {linears[0], linears[2]} | {n for n in block.nodes if ev.node(n).kind == "attention"}
    again = sum(ev.node_cost(ev.node(n), roles.get(n, "replicate"), config).fwd for n in block.nodes if n not in kept)
    assert cost.recompute == pytest.approx(again) and 0 < cost.recompute < none.forward
    # a layer without attention (the embedding) is not a block: selective changes nothing there
    embed = graph.layers[0]
    assert ev.layer_cost(embed, config).saved == pytest.approx(
        ev.layer_cost(embed, dataclasses.replace(config, recompute="none")).saved)
    with pytest.raises(ValueError, match="selective='layer'"):
        Evaluator(graph, A100, selective="layer")
