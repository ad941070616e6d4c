"""Tensor parallelism for grouped-query attention run for real: the generated rank scripts over gloo
train the example GPT with 4 query heads and 2 key/value heads (SDPA with enable_gqa, dropout 0) at
tensor 2, tensor 2 with sequence parallelism, and data 2 x tensor 2, and Hugging Face Llama with 8
attention heads and 2 key/value heads (repeat_kv before SDPA) at tensor 2, 3 steps each; every loss,
gradient and parameter equals the single-process reference (--verify), with the attention split
by heads (q by its query heads, k and v by their key/value heads), not replicated."""

import json

import pytest

from runtime.launch.launcher import run_many
from tests.real_models import HF, assert_verified, emit_fixed

GPT = "examples/models/gpt.py:build"
GPT_GQA = {"preset": "tiny", "num_kv_heads": 2}
LLAMA_GQA = {"arch": "llama", "num_attention_heads": 8, "num_key_value_heads": 2}
# the first layer's q and k projections in each build's stored split: a module's [role, factors, split
# factor] (sequence parallelism adds the sequence dimension after), a weight's [dimension, factors, split factor]
SPLIT_Q_K = {
    GPT: ("modules", "blocks.0.attn.q", "blocks.0.attn.k", ["column", [4, 8], 0], ["column", [2, 8], 0]),
    HF: ("params", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
         [0, [8, 8], 0], [0, [2, 8], 0]),
}
CASES = {
    "gpt_t2": (GPT, GPT_GQA, dict(tensor=2)),
    "gpt_t2_sp": (GPT, GPT_GQA, dict(tensor=2, sequence_parallel=True)),
    "gpt_d2t2": (GPT, GPT_GQA, dict(data=2, tensor=2)),
    "llama_t2": (HF, LLAMA_GQA, dict(tensor=2)),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("gqa")
    builds = {name: emit_fixed(root, ref, kw, name, cfg) for name, (ref, kw, cfg) in CASES.items()}
    out = {}
    for world in (2, 4):   # run_many runs builds of one world size together
        names = [n for n, (_r, _k, cfg) in CASES.items() if cfg.get("data", 1) * cfg["tensor"] == world]
        out.update(zip(names, run_many([builds[n] for n in names], steps=3, backend="gloo", timeout=180,
                                       verify=True)))
    return builds, out


@pytest.mark.parametrize("name", sorted(CASES))
def test_gqa_under_tensor_parallelism_equals_single_process(results, name):
    builds, runs = results
    kind, q, k, q_split, k_split = SPLIT_Q_K[CASES[name][0]]
    stored = json.loads((builds[name] / "plan.json").read_text())["tensor_splits"][kind]
    assert (stored[q][:3], stored[k][:3]) == (q_split, k_split), f"{name}: attention not split by heads"
    assert_verified(runs[name], name)
