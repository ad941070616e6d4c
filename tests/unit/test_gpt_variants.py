"""examples/models/gpt.py's config fields for the published models: grouped-query attention, SwiGLU and
ReLU MLPs, tied embeddings, no position table; parameter counts of the presets."""

import pytest
import torch

from examples.models import gpt

GQA = dict(num_kv_heads=2, activation="swiglu", mlp_hidden=48, bias=False, positions="none")


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())   # a tied weight once


def test_gqa_swiglu_parameter_count_by_hand():
    # tiny: V 128, C 32, 2 layers, 4 heads (D 8), 2 kv heads, I 48, no biases, no position table.
    # per block: norms 2*32; q 32*32 + k 32*16 + v 32*16 + proj 32*32 = 3072; gate, fc, proj 3*32*48 = 4608
    # total: wte 128*32 + 2 * 7744 + ln_f 32 + lm_head 32*128 = 23712
    model = gpt.build("tiny", **GQA)
    assert gpt.num_params(model.config) == _count(model) == 23712
    names = dict(model.named_modules())
    assert names["blocks.0.attn.k"].out_features == 16 and "blocks.0.attn.qkv" not in names
    assert names["blocks.0.mlp.gate"].out_features == 48 and "wpe" not in names


def test_gqa_equals_multi_head_attention_with_repeated_key_value_heads():
    torch.manual_seed(0)
    gqa = gpt.build("tiny", num_kv_heads=2).eval()
    mha = gpt.build("tiny").eval()
    d, group = gqa.config.head_dim, 2   # query head h reads key/value head h // 2
    with torch.no_grad():
        for src, dst in zip(gqa.blocks, mha.blocks):
            a = src.attn
            heads = [h // group for h in range(4)]
            k_w = torch.cat([a.k.weight[j * d:(j + 1) * d] for j in heads])
            v_w = torch.cat([a.v.weight[j * d:(j + 1) * d] for j in heads])
            k_b = torch.cat([a.k.bias[j * d:(j + 1) * d] for j in heads])
            v_b = torch.cat([a.v.bias[j * d:(j + 1) * d] for j in heads])
            dst.attn.qkv.weight.copy_(torch.cat([a.q.weight, k_w, v_w]))
            dst.attn.qkv.bias.copy_(torch.cat([a.q.bias, k_b, v_b]))
        state = {k: v for k, v in gqa.state_dict().items() if ".attn.q." not in k and ".attn.k." not in k
                 and ".attn.v." not in k}
        mha.load_state_dict(state, strict=False)
    (idx,), _ = gpt.example_batch(2, seed=0)
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-5)


def test_relu_and_swiglu_mlps():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32)
    relu = gpt.build("tiny", activation="relu").blocks[0].mlp
    assert isinstance(relu.act, torch.nn.ReLU)
    torch.testing.assert_close(relu(x), relu.proj(torch.relu(relu.fc(x))))
    glu = gpt.build("tiny", activation="swiglu", mlp_hidden=48).blocks[0].mlp
    torch.testing.assert_close(glu(x), glu.proj(torch.nn.functional.silu(glu.gate(x)) * glu.fc(x)))


def test_tied_embeddings_share_one_weight():
    model = gpt.build("tiny", tie_embeddings=True)
    assert model.lm_head.weight is model.wte.weight
    untied = gpt.make_config("tiny")
    assert gpt.num_params(model.config) == _count(model) == gpt.num_params(untied) - 128 * 32


def test_bad_variant_fields_name_the_field():
    with pytest.raises(ValueError, match="activation='tanh'.*gelu, relu, swiglu"):
        gpt.make_config("tiny", activation="tanh")
    with pytest.raises(ValueError, match="num_kv_heads=3 does not divide num_heads=4"):
        gpt.make_config("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="mlp_hidden"):
        gpt.make_config("tiny", mlp_hidden=0)
    assert gpt.make_config("tiny", activation=gpt.Activation.RELU).activation == "relu"   # held as the string


def test_published_presets_parameter_counts():
    # BLOOM's model card: 176,247,271,424 parameters; the GPT here lacks BLOOM's embedding LayerNorm (2 x 14336)
    assert gpt.num_params(gpt.make_config("bloom-176b")) + 2 * 14336 == 176_247_271_424
    # Meta-Llama-3-70B: 70,553,706,496 parameters (80 x (2.25 + 3 x 3.5) h^2 + norms + 2 x 128256 x 8192)
    assert gpt.num_params(gpt.make_config("llama-70b")) == 70_553_706_496
    assert 175e9 < gpt.num_params(gpt.make_config("opt-175b")) < 175.5e9
    assert 175e9 < gpt.num_params(gpt.make_config("megascale-175b")) < 176e9
    with torch.device("meta"):
        model = gpt.build("llama-70b", seq_len=32768)
    assert _count(model) == 70_553_706_496   # no position table: the count does not grow with the sequence
