"""Hugging Face models built from configs (no download) capture without changes to their code."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import planner

import transformers  # noqa: E402  (the dev extra installs it; a missing one must fail, not skip)


def _gpt2(attn):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation=attn)
    return transformers.GPT2LMHeadModel, cfg, "transformer.h."


def _bert(attn):
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=1000, use_cache=False,
                                  attn_implementation=attn)
    return transformers.BertModel, cfg, "encoder.layer."


def _llama(attn):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=1000,
                                   use_cache=False, attn_implementation=attn)
    return transformers.LlamaForCausalLM, cfg, "model.layers."


MODELS = {"gpt2": _gpt2, "bert": _bert, "llama": _llama}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model_captures_on_meta(name):
    cls, cfg, block_prefix = MODELS[name]("sdpa")
    with torch.device("meta"):
        model = cls(cfg)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    g = planner.capture(model, (ids,))
    assert g.method in ("fx", "export")
    assert g.num_params == sum(p.numel() for p in model.parameters())
    blocks = [layer for layer in g.layers if layer.name.startswith(block_prefix)]
    assert [b.name for b in blocks] == [f"{block_prefix}0", f"{block_prefix}1"]
    assert blocks[0].signature == blocks[1].signature
    assert len([br for br in g.branches if br.kind == "heads"]) == 2
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_flops_match_flop_counter(name):
    # Eager attention: the CPU's fused attention kernel is not in flop_counter's
    # table, so the reference would miss the attention matmuls.
    cls, cfg, _ = MODELS[name]("eager")
    torch.manual_seed(0)
    model = cls(cfg)
    ids = torch.randint(0, 1000, (2, 16))
    with FlopCounterMode(display=False) as fc:
        model(ids)
    ref = fc.get_total_flops()
    g = planner.capture(model, (ids,))
    assert ref > 0
    assert abs(g.total_fwd_flops - ref) <= 0.01 * ref
    assert g.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,pairs", [
    ("llama", {"self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
               "self_attn.o_proj": "row", "mlp.gate_proj": "column", "mlp.up_proj": "column",
               "mlp.down_proj": "row"}),
    ("bert", {"attention.self.query": "column", "attention.self.key": "column", "attention.self.value": "column",
              "attention.output.dense": "row", "intermediate.dense": "column", "output.dense": "row"}),
])
def test_tensor_parallel_roles_found_without_model_special_cases(name, pairs):
    from planner.strategies.tensor.sharding import find_sharding

    cls, cfg, block_prefix = MODELS[name]("sdpa")
    with torch.device("meta"):
        model = cls(cfg)
    g = planner.capture(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    roles = find_sharding(g).roles
    by_path = {n.module_path: roles[n.name].role for n in g.nodes if n.kind == "linear"}
    for suffix, role in pairs.items():
        assert by_path[f"{block_prefix}0.{suffix}"] == role, suffix
    attn = [n for n in g.nodes if n.kind == "attention"]
    assert attn and all(roles[n.name].role == "inner" for n in attn)
