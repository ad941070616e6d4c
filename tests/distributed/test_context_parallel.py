"""Context parallelism run for real (gloo, CPU): the example GPT (dropout 0, causal attention,
16 tokens) trained 3 steps with --verify equal to the single-process reference under context 2
alone and combined with data (with ZeRO), tensor and a 1F1B pipeline, with ring and Ulysses
attention; an HF Llama whose causal mask becomes the attention's causal flag; what cannot be
split is refused with a sentence naming it.

The 4-rank builds run in one set of worker processes (runtime.launch.worker), each with its own rendezvous.
"""

import pytest

import planner
from planner.app.commands import make_fixed_plan
from runtime.launch.launcher import run_many
from tests.parallel_cases import assert_exact, emit_case
from tests.real_models import HF, assert_verified, emit_fixed, graph_of

LLAMA = {"arch": "llama"}   # 16 tokens, as wide as a head: views keep the sequence apart from the heads
# recompute runs the exchange again inside backward: full (the layer), selective (the attention alone)
TWO_RANKS = {"c2_ring": dict(context=2), "c2_recompute_full": dict(context=2, recompute="full"),
             "c2_recompute_selective_ulysses": dict(context=2, recompute="selective", context_attention="ulysses")}
FOUR_RANKS = {
    "d2c2_ulysses": dict(data=2, context=2, context_attention="ulysses"),
    "c2t2_ring": dict(context=2, tensor=2),
    "p2c2_1f1b_ring": dict(pipeline=2, context=2, schedule="1f1b"),
    "d2c2_zero3_ring": dict(data=2, context=2, zero=3),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("context")
    two = {name: emit_case(root, "gpt", name, cfg) for name, cfg in TWO_RANKS.items()}
    two["llama_c2_ring"] = emit_fixed(root, HF, LLAMA, "llama_c2_ring", dict(context=2))
    four = {name: emit_case(root, "gpt", name, cfg) for name, cfg in FOUR_RANKS.items()}
    results = {}
    for builds in (two, four):
        results.update(zip(builds, run_many(list(builds.values()), steps=3, backend="gloo", timeout=60, verify=True)))
    return results


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_context_parallel_run_equals_single_process(runs, name):
    assert_exact(runs[name], name)
    per_rank = list(runs[name].losses.values())
    assert all(x == per_rank[0] for x in per_rank), f"{name}: the ranks report different losses"


def test_hf_llama_causal_mask_becomes_the_causal_flag_and_trains_exactly(runs):
    """The HF Llama (grouped-query attention) builds its causal mask from the sequence length; the
    lowering finds it is the causal triangle and runs attention with causal=True."""
    assert_verified(runs["llama_c2_ring"], "llama context 2")


def test_a_sequence_not_divisible_by_2c_is_refused_naming_both_numbers():
    graph = graph_of("examples/models/gpt.py:build", (("preset", "tiny"), ("seq_len", 18)))
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", context=2)
    with pytest.raises(ValueError, match=r"2 x 2 = 4 chunks.*18 tokens"):
        make_fixed_plan(graph, planner.Cluster.preset("local", devices=2), config, 8)

