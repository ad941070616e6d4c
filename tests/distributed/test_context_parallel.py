"""Context parallelism run for real (gloo, CPU): the example GPT (dropout 0, causal attention,
16 tokens) trained 3 steps with --verify equal to the single-process reference under context 2
alone and combined with data (with ZeRO), tensor and a 1F1B pipeline, with ring and Ulysses
attention; an HF Llama whose causal mask becomes the attention's causal flag; what cannot be
split is refused with a sentence naming it.

The 4-rank builds run in one set of worker processes (runtime.worker), each with its own rendezvous.
"""

import pytest

import planner
from codegen.lower import lower_plan
from codegen.strategies.base import LoweringError
from planner.app.commands import make_fixed_plan
from runtime.launcher import run_many
from tests.parallel_cases import assert_exact, emit_case
from tests.real_models import HF, assert_verified, emit_fixed, graph_of

LLAMA = {"arch": "llama", "seq_len": 48}   # a length unlike the model's sizes (head width 16, k/v width 32)
# full recompute runs the ring's exchange again inside backward
TWO_RANKS = {"c2_ring": dict(context=2), "c2_recompute_full": dict(context=2, recompute="full")}
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
    """The HF Llama (48 tokens, grouped-query attention) builds its causal mask from the sequence
    length; the lowering finds it is the causal triangle and runs attention with causal=True."""
    assert_verified(runs["llama_c2_ring"], "llama context 2")


def _plan(ref_kwargs: tuple, **cfg):
    graph = graph_of(*ref_kwargs)
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
    return graph, make_fixed_plan(graph, planner.Cluster.preset("local", devices=config.num_devices), config, 8)


def test_a_sequence_not_divisible_by_2c_is_refused_naming_both_numbers():
    with pytest.raises(ValueError, match=r"2 x 2 = 4 chunks.*18 tokens"):
        _plan(("examples/models/gpt.py:build", (("preset", "tiny"), ("seq_len", 18))), context=2)


def test_hf_llama_at_its_default_length_is_refused_naming_the_clash():
    """At 16 tokens the tiny Llama's head width (16) equals the sequence length: which dimension of
    a (B, T, H, D) value is the sequence cannot be told, so the lowering refuses and says so."""
    graph, plan = _plan((HF, (("arch", "llama"),)), context=2)
    with pytest.raises(LoweringError, match=r"holds the sequence length 16 on several dimensions.*choose a sequence "
                                            "length that differs"):
        lower_plan(plan, graph)
