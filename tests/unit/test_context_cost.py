"""Context parallelism priced: the ring / Ulysses exchange formulas (hand-computed), the per-rank
layer cost and memory of a GPT block, the gradient sync over data x context, the refusals and the
degrees the search offers."""

from __future__ import annotations

import pytest
import torch

import planner
from cost_models.comm import link_models
from planner.strategies.context.costs import ExchangeSeconds, ring_attention, ring_exposed, ulysses
from cost_models.hardware import Cluster
from examples.models import gpt, mlp
from planner import ParallelConfig
from planner.config import ConfigError
from planner.evaluator import Evaluator
from planner.strategies.context.strategy import (MIN_SEARCH_TOKENS_PER_RANK, ContextStrategy, check_config,
                                        search_degrees, sequence_length)


# ---- formulas ---------------------------------------------------------------

def test_ring_exposes_the_first_latency_and_what_each_transfer_takes_beyond_its_block():
    # 3 transfers of 5 s beside blocks of 2 s: 1 + 3 x (5 - 2)
    assert ring_exposed(3, transfer=5.0, latency=1.0, compute=2.0) == 10.0
    # blocks longer than the transfers hide them all but the first latency
    assert ring_exposed(3, transfer=5.0, latency=1.0, compute=7.0) == 1.0
    assert ring_exposed(0, transfer=5.0, latency=1.0, compute=0.0) == 0.0


def test_ring_attention_runs_c_minus_1_steps_and_backward_moves_twice_the_bytes():
    def p2p(n):   # 10 us latency, 1 GB/s
        return 1e-5 + n / 1e9

    got = ring_attention(4, kv_bytes=2e6, p2p=p2p, attention_forward=4e-3, attention_backward=8e-3)
    latency = 1e-5 + 1e-9
    # forward: a step sends 2 MB (2.01 ms) beside 4 ms / 4 = 1 ms of attention, 3 steps
    assert got.forward == pytest.approx(latency + 3 * (2.01e-3 - 1e-3), rel=1e-12)
    # backward: k, v and dk, dv: 4 MB (4.01 ms) beside 8 ms / 4 = 2 ms
    assert got.backward == pytest.approx(latency + 3 * (4.01e-3 - 2e-3), rel=1e-12)
    assert ring_attention(1, 2e6, p2p, 4e-3, 8e-3) == ExchangeSeconds(0.0, 0.0)


def test_ulysses_is_three_all_to_alls_in_and_one_out_each_way_none_hidden():
    def a2a(n):   # 4 ranks: 3 rounds of 10 us, 3/4 of the bytes at 1 GB/s
        return 3e-5 + 0.75 * n / 1e9

    got = ulysses(4, (1e6, 5e5, 5e5), 1e6, a2a)
    each = 4 * 3e-5 + 0.75 * (1e6 + 5e5 + 5e5 + 1e6) / 1e9   # 4 all-to-alls: 2.37 ms
    assert got.forward == pytest.approx(each, rel=1e-12) and got.backward == pytest.approx(each, rel=1e-12)
    assert ulysses(1, (1e6, 1e6, 1e6), 1e6, a2a) == ExchangeSeconds(0.0, 0.0)


# ---- the Evaluator on a GPT ------------------------------------------------

SEQ, HEADS, HIDDEN = 256, 4, 128
D = HIDDEN // HEADS


def _graph(mod=gpt, **kw):
    with torch.device("meta"):
        model = mod.build(**kw)
    return planner.capture(model, mod.example_inputs(batch_size=1, device="meta", **kw))


@pytest.fixture(scope="module")
def graph():
    return _graph(preset="small", seq_len=SEQ)


@pytest.fixture(scope="module")
def node():
    return Cluster.preset("dgx-a100-80gb", nodes=1)   # 8 GPUs on NVLink


def _block(ev):
    """The first transformer block and its attention node."""
    for layer in ev.graph.layers:
        attn = [ev.node(n) for n in layer.nodes if ev.node(n).kind == "attention"]
        if attn:
            return layer, attn[0]
    raise AssertionError("no attention layer")


def test_sequence_length_is_read_off_the_attention_ops(graph, node):
    assert sequence_length(Evaluator(graph, node)) == SEQ


def test_ring_block_does_half_the_work_and_exposes_its_kv_transfer(graph, node):
    ev = Evaluator(graph, node)
    layer, attn = _block(ev)
    plain = ParallelConfig(data=8, micro_batch_size=2)
    cp = ParallelConfig(data=4, context=2, micro_batch_size=2)
    base = ev.layer_cost(layer, plain)
    got = ev.layer_cost(layer, cp)
    assert got.forward == pytest.approx(base.forward / 2) and got.backward == pytest.approx(base.backward / 2)
    assert got.saved == pytest.approx(base.saved / 2) and got.boundary == pytest.approx(base.boundary / 2)
    assert got.params == base.params   # whole weights on every context rank
    intra, _ = link_models(node)
    # this rank's k and v: 2 samples x 128 tokens x 4 heads x 32 channels x 2 bytes (bf16), twice
    kv = 2 * (2 * 128 * HEADS * D * 2)
    assert kv == 131072
    a = ev.node_cost(attn, "replicate", plain)   # the whole sequence's attention on one rank
    block_f, block_b = a.fwd / 2 / 2, a.bwd / 2 / 2   # this rank's half, in 2 blocks
    fwd = (intra.alpha + intra.beta) + max(0.0, intra.alpha + kv * intra.beta - block_f)
    bwd = (intra.alpha + intra.beta) + max(0.0, intra.alpha + 2 * kv * intra.beta - block_b)
    assert got.comm_forward == pytest.approx(fwd, rel=1e-9)
    assert got.comm_backward == pytest.approx(bwd, rel=1e-9)
    # the recomputed attention exchanges again in backward
    rc = ev.layer_cost(layer, cp.replace(recompute="full"))
    assert rc.comm_backward == pytest.approx(bwd + fwd, rel=1e-9)


def test_ulysses_block_pays_four_all_to_alls_each_way(graph, node):
    ev = Evaluator(graph, node)
    layer, _ = _block(ev)
    got = ev.layer_cost(layer, ParallelConfig(data=4, context=2, micro_batch_size=2, context_attention="ulysses"))
    intra, _ = link_models(node)
    q = 2 * 128 * HEADS * D * 2   # q, k, v and the output are each this size on a rank: 65536 bytes
    a2a = (2 - 1) * intra.alpha + (2 - 1) / 2 * q * intra.beta
    assert got.comm_forward == pytest.approx(4 * a2a, rel=1e-9)
    assert got.comm_backward == pytest.approx(4 * a2a, rel=1e-9)


def test_activations_divided_by_c_weights_and_optimizer_state_not(graph, node):
    ev = Evaluator(graph, node)
    plain = ev.evaluate(ParallelConfig(data=8), 8)
    cp = ev.evaluate(ParallelConfig(data=4, context=2), 8)
    assert cp.memory.activations == pytest.approx(plain.memory.activations / 2)
    assert cp.memory.parameters == plain.memory.parameters
    assert cp.memory.optimizer == plain.memory.optimizer
    # the same tokens per step on every rank: the same compute
    assert cp.time.forward == pytest.approx(plain.time.forward)


def test_gradients_are_summed_over_data_x_context(graph, node):
    ev = Evaluator(graph, node)
    # every config below sums its gradients over the same 8 ranks, each rank's last backward
    # covering one sample's tokens: the same exposed sync
    d8 = ev.evaluate(ParallelConfig(data=8), 8).time.data_comm
    assert d8 > 0
    assert ev.evaluate(ParallelConfig(data=4, context=2, micro_batch_size=2), 8).time.data_comm == pytest.approx(d8)
    assert ev.evaluate(ParallelConfig(context=8, micro_batch_size=8), 8).time.data_comm == pytest.approx(d8)


# ---- refusals ---------------------------------------------------------------

def test_a_sequence_not_divisible_by_2c_is_refused_naming_the_numbers(node):
    ev = Evaluator(_graph(preset="small", seq_len=40), node)
    with pytest.raises(ConfigError, match=r"context=8 cuts each sequence into 2 x 8 = 16 chunks .* 40 tokens"):
        ev.evaluate(ParallelConfig(context=8, micro_batch_size=1), 1)
    check_config(ev, ParallelConfig(data=2, context=4))   # 40 = 5 x 8


def test_ulysses_needs_heads_per_tensor_rank_divisible_by_c(graph, node):
    ev = Evaluator(graph, node, sharding="all")
    with pytest.raises(ConfigError, match="has 4 attention heads per tensor rank \\(tensor=1\\)"):
        check_config(ev, ParallelConfig(context=8, context_attention="ulysses"))
    with pytest.raises(ConfigError, match="has 2 attention heads per tensor rank \\(tensor=2\\)"):
        check_config(ev, ParallelConfig(tensor=2, context=4, context_attention="ulysses"))
    check_config(ev, ParallelConfig(tensor=2, context=2, data=2, context_attention="ulysses"))
    check_config(ev, ParallelConfig(tensor=2, context=4, context_attention="ring"))   # ring keeps all heads


def test_attention_dropout_is_refused_as_the_lowering_refuses_it(node):
    ev = Evaluator(_graph(preset="small", seq_len=64, dropout=0.1), node)
    with pytest.raises(ConfigError, match=r"attention op 'scaled_dot_product_attention' \(blocks.0.attn\) has "
                                          r"dropout_p=0.1; set the model's attention dropout to 0, or use context=1"):
        check_config(ev, ParallelConfig(data=2, context=2))
    check_config(Evaluator(_graph(preset="small", seq_len=64), node), ParallelConfig(data=2, context=2))


def test_a_model_without_attention_is_refused(node):
    ev = Evaluator(_graph(mlp, in_features=8, hidden=16, num_layers=2, out_features=4), node)
    with pytest.raises(ConfigError, match="no attention op; use context=1"):
        ev.evaluate(ParallelConfig(data=4, context=2), 4)


# ---- search -----------------------------------------------------------------

def test_search_degrees_are_powers_of_two_keeping_enough_tokens_per_rank(node):
    ev = Evaluator(_graph(preset="small", seq_len=4 * MIN_SEARCH_TOKENS_PER_RANK), node)
    assert search_degrees(ev, 8, {}) == [2, 4]      # 8 would leave half the minimum per rank
    assert search_degrees(ev, 6, {}) == [2]         # 4 does not divide 6 devices
    assert search_degrees(ev, 8, {"context": 8}) == [8]
    assert search_degrees(ev, 8, {"context": 1}) == []


def test_variants_skip_micro_batches_divisible_by_c_and_pin_the_mode(graph, node):
    ev = Evaluator(graph, node)

    def shapes_of(n):
        return [ParallelConfig(data=n, micro_batch_size=mb) for mb in (1, 2, 3)]

    got = ContextStrategy().variants(ev, 8, {"context": 2}, shapes_of)
    assert {(c.data, c.context, c.micro_batch_size, c.context_attention) for c in got} == {
        (4, 2, mb, mode) for mb in (1, 3) for mode in ("ring", "ulysses")}
    got = ContextStrategy().variants(ev, 8, {"context": 2, "context_attention": "ring"}, shapes_of)
    assert {c.context_attention for c in got} == {"ring"}


def test_cli_optimize_what_if_pins_the_context_constraints(tmp_path, capsys):
    from planner import Plan
    from planner.app.cli import main

    out = tmp_path / "plan.json"
    assert main(["optimize", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--cluster", "dgx-a100-80gb",
                 "--batch", "16", "--quiet", "--what-if", "--constraint", "context=2",
                 "--constraint", "context_attention=ulysses", "-o", str(out)]) == 0
    assert " c2 ulysses " in capsys.readouterr().out
    config = Plan.load(out).config
    assert (config.context, config.context_attention) == (2, "ulysses")
    assert main(["optimize", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--cluster", "dgx-a100-80gb",
                 "--batch", "16", "--quiet", "--what-if", "--constraint", "context=two", "-o", str(out),
                 "--force"]) == 2
    assert "context takes a whole number" in capsys.readouterr().err
