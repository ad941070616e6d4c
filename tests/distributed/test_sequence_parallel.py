"""Sequence parallelism run for real: the generated rank scripts over gloo train the example GPT
(dropout 0) for 3 steps under tensor 2 + SP, data 2 x tensor 2 + SP and pipeline 2 x tensor 2 + SP
(1F1B), and a Hugging Face Llama (RMSNorm, grouped-query attention, an ATen graph) under tensor 2 +
SP; every loss, gradient and parameter equals the single-process reference (--verify)."""

import pytest

from runtime.launcher import run_many
from tests.parallel_cases import assert_exact, emit_case
from tests.real_models import HF, assert_verified, emit_fixed

FOUR_RANKS = {
    "d2t2_sp": dict(data=2, tensor=2, sequence_parallel=True),
    "p2t2_sp": dict(pipeline=2, tensor=2, sequence_parallel=True, schedule="1f1b"),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp2")
    builds = {"gpt_t2_sp": emit_case(root, "gpt", "t2_sp", dict(tensor=2, sequence_parallel=True)),
              "llama_t2_sp": emit_fixed(root, HF, {"arch": "llama"}, "llama_t2_sp",
                                        dict(tensor=2, sequence_parallel=True))}
    results = run_many(list(builds.values()), steps=3, backend="gloo", timeout=120, verify=True)
    return dict(zip(builds, results))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp4")
    builds = {name: emit_case(root, "gpt", name, cfg) for name, cfg in FOUR_RANKS.items()}
    results = run_many(list(builds.values()), steps=3, backend="gloo", timeout=120, verify=True)
    return dict(zip(builds, results))


def test_gpt_tensor_2_with_sp_equals_single_process(two_ranks):
    assert_exact(two_ranks["gpt_t2_sp"], "gpt t2 sp")


def test_llama_tensor_2_with_sp_equals_single_process(two_ranks):
    assert_verified(two_ranks["llama_t2_sp"], "llama t2 sp")


@pytest.mark.parametrize("name", sorted(FOUR_RANKS))
def test_gpt_data_and_pipeline_with_tensor_sp_equal_single_process(four_ranks, name):
    assert_exact(four_ranks[name], f"gpt {name}")

