"""Context parallelism run for real (gloo, CPU): the example GPT (dropout 0, causal attention,
16 tokens) trained 3 steps with --verify equal to the single-process reference under context 2
alone and combined with data (with ZeRO), tensor and a 1F1B pipeline, with ring and Ulysses
attention; what cannot be split is refused with a sentence naming it.

The 4-rank builds run in one set of worker processes (runtime.worker), each with its own rendezvous.
"""

import pytest

import planner
from codegen.lower import lower_plan
from codegen.strategies.base import LoweringError
from planner.app.commands import make_fixed_plan
from runtime.launcher import run_many
from tests.parallel_cases import assert_exact, emit_case
from tests.real_models import HF, graph_of

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


def _plan(ref_kwargs: tuple, **cfg):
    graph = graph_of(*ref_kwargs)
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
    return graph, make_fixed_plan(graph, planner.Cluster.preset("local", devices=config.num_devices), config, 8)


def test_a_sequence_not_divisible_by_2c_is_refused_naming_both_numbers():
    with pytest.raises(ValueError, match=r"2 x 2 = 4 chunks.*18 tokens"):
        _plan(("examples/models/gpt.py:build", (("preset", "tiny"), ("seq_len", 18))), context=2)


def test_hf_llama_mask_is_refused_naming_the_attention():
    """The HF Llama builds a (B, 1, T, T) mask from the sequence length and hands it to SDPA: it does
    not follow the sequence's chunks, so the lowering refuses it and says what would run."""
    graph, plan = _plan((HF, (("arch", "llama"),)), context=2)
    with pytest.raises(LoweringError, match=r"cannot split the attention mask of node 'scaled_dot_product_attention' "
                                            r"at model\.layers\.0\.self_attn .*is_causal=True"):
        lower_plan(plan, graph)
