"""Sequence parallelism run for real: the generated rank scripts over gloo train the example GPT
(dropout 0) for 3 steps under tensor 2 + SP (also with full recompute), data 2 x tensor 2 + SP (also
with ZeRO-3) and pipeline 2 x tensor 2 + SP (1F1B), and Hugging Face Llama (RMSNorm, grouped-query
attention) and BERT (LayerNorm weights and biases read directly, learned position and token-type
embeddings cut to each rank's tokens, the masked-LM head's replicated transform reading the whole
sequence), both ATen graphs, under tensor 2 + SP; every loss, gradient and parameter equals the
single-process reference (--verify)."""

import pytest

from runtime.launch.launcher import run_many
from tests.parallel_cases import assert_exact, emit_case
from tests.real_models import HF, assert_verified, emit_fixed

FOUR_RANKS = {
    "d2t2_sp": dict(data=2, tensor=2, sequence_parallel=True),
    "p2t2_sp": dict(pipeline=2, tensor=2, sequence_parallel=True, schedule="1f1b"),
    # ZeRO-3 frees and re-gathers the parameters whose gradients the norms' hooks all-reduce
    "d2t2_sp_zero3": dict(data=2, tensor=2, sequence_parallel=True, zero=3),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp2")
    builds = {"gpt_t2_sp": emit_case(root, "gpt", "t2_sp", dict(tensor=2, sequence_parallel=True)),
              # the recomputed forward repeats the gathers and reduce-scatters
              "gpt_t2_sp_recompute": emit_case(root, "gpt", "t2_sp_recompute",
                                               dict(tensor=2, sequence_parallel=True, recompute="full")),
              **{f"{arch}_t2_sp": emit_fixed(root, HF, {"arch": arch}, f"{arch}_t2_sp",
                                             dict(tensor=2, sequence_parallel=True)) for arch in ("llama", "bert")}}
    results = run_many(list(builds.values()), steps=3, backend="gloo", timeout=120, verify=True)
    return dict(zip(builds, results))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp4")
    builds = {name: emit_case(root, "gpt", name, cfg) for name, cfg in FOUR_RANKS.items()}
    results = run_many(list(builds.values()), steps=3, backend="gloo", timeout=120, verify=True)
    return dict(zip(builds, results))


@pytest.mark.parametrize("name", ["gpt_t2_sp", "gpt_t2_sp_recompute"])
def test_gpt_tensor_2_with_sp_equals_single_process(two_ranks, name):
    assert_exact(two_ranks[name], name)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_hf_models_at_tensor_2_with_sp_equal_single_process(two_ranks, arch):
    assert_verified(two_ranks[f"{arch}_t2_sp"], f"{arch} t2 sp")


@pytest.mark.parametrize("name", sorted(FOUR_RANKS))
def test_gpt_data_and_pipeline_with_tensor_sp_equal_single_process(four_ranks, name):
    assert_exact(four_ranks[name], f"gpt {name}")

