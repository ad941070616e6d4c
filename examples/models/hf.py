"""Hugging Face transformers models, built from a config (nothing is downloaded), as meshplan factories.

    meshplan optimize examples/models/hf.py:build --arg arch=gpt2 --arg preset=gpt2 --cluster dgx-a100-80gb \\
        --nodes 2 --batch 512
    meshplan codegen examples/models/hf.py:build --arg arch=llama --batch 8 --data 2 -o build
    meshplan run build --steps 3 --verify

The models are transformers' own classes, unchanged: GPT-2 (tied input and output
embeddings), Llama, Qwen2 and Mistral (grouped-query attention, rotary positions; Mistral's
sliding-window attention), BERT for masked
language modelling (tied prediction head), T5 (encoder-decoder, tied head) and ViT (image
classification). `preset` picks a size: "tiny" (the tests' size: a few layers, odd
vocabularies where the architecture has one), "small" (GPT-2 and Llama: 4 layers of width
256, trained on a CPU in the examples and benchmarks; GPT-2 keeps its 50257-token
vocabulary) or the published base size ("gpt2", "llama-7b", ...; see PRESETS). Any keyword the config accepts overrides the preset (for example
`--arg n_layer=4`); `seq_len` and `image_size` set the example batch.

Every preset sets dropout to 0, so that a run can be checked against the single-process run
(`meshplan run --verify`): dropout draws different random numbers on every rank.

Inputs are keyword tensors, as Hugging Face models take them:
  causal LMs (gpt2, llama, qwen2, mistral): {"input_ids": (B, T) int64} -> logits (B, T, V)
  bert (masked LM):               {"input_ids": (B, T) int64} -> logits (B, T, V)
  t5:                             {"input_ids": (B, T), "decoder_input_ids": (B, T)} -> logits (B, T, V)
  vit:                            {"pixel_values": (B, 3, S, S) float32} -> logits (B, num_labels)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ARCHS = ("gpt2", "llama", "qwen2", "mistral", "bert", "t5", "vit")

# (config class, model class, preset -> config fields). Names are transformers' own.
_TINY_TEXT = {"vocab_size": 1001}
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {
        "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, **_TINY_TEXT},
        "small": {"n_layer": 4, "n_embd": 256, "n_head": 8, "n_positions": 256, "vocab_size": 50257},
        "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257},
        "gpt2-medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 1024, "vocab_size": 50257},
    },
    "llama": {
        "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 64},
        "small": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
                  "intermediate_size": 688, "vocab_size": 32000, "max_position_embeddings": 256},
        "llama-1b": {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256},
        "llama-7b": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                     "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000},
    },
    "qwen2": {
        "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 64},
        "qwen2-0.5b": {"num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
                       "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936},
    },
    "mistral": {
        "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 64, "sliding_window": 64},
        "mistral-7b": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                       "sliding_window": 4096},
    },
    "bert": {
        "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                 "max_position_embeddings": 64, **_TINY_TEXT},
        "bert-base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                      "intermediate_size": 3072, "vocab_size": 30522},
    },
    "t5": {
        "tiny": {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_heads": 4,
                 "vocab_size": 1000},
        "t5-small": {"num_layers": 6, "num_decoder_layers": 6, "d_model": 512, "d_kv": 64, "d_ff": 2048,
                     "num_heads": 8, "vocab_size": 32128},
    },
    "vit": {
        "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                 "image_size": 32, "patch_size": 8, "num_labels": 10},
        "vit-base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                     "intermediate_size": 3072, "image_size": 224, "patch_size": 16, "num_labels": 1000},
    },
}

# Dropout fields per architecture (all set to 0 unless overridden).
_DROPOUT = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "llama": ("attention_dropout",),
    "qwen2": ("attention_dropout",),
    "mistral": ("attention_dropout",),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "t5": ("dropout_rate",),
    "vit": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
}
_DATA_KEYS = ("seq_len", "image_size")


def _classes(arch: str):
    import transformers

    table = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "bert": (transformers.BertConfig, transformers.BertForMaskedLM),
        "t5": (transformers.T5Config, transformers.T5ForConditionalGeneration),
        "vit": (transformers.ViTConfig, transformers.ViTForImageClassification),
    }
    if arch not in table:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    return table[arch]


def config(arch: str = "gpt2", preset: str = "tiny", **overrides: Any):
    """The transformers config of `arch` at `preset`, with `overrides` applied (dropout 0 unless given)."""
    if arch not in PRESETS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    if preset not in PRESETS[arch]:
        raise ValueError(f"unknown preset {preset!r} for {arch}; known: {', '.join(PRESETS[arch])}")
    cfg_cls, _ = _classes(arch)
    fields: dict[str, Any] = {name: 0.0 for name in _DROPOUT[arch]}
    fields.update(PRESETS[arch][preset])
    fields.update({k: v for k, v in overrides.items() if k not in _DATA_KEYS})
    if arch == "vit" and "image_size" in overrides:
        fields["image_size"] = overrides["image_size"]
    if arch in ("gpt2", "llama", "qwen2", "mistral", "t5"):
        fields.setdefault("use_cache", False)
    return cfg_cls(**fields)


def build(arch: str = "gpt2", preset: str = "tiny", **overrides: Any) -> nn.Module:
    """The model, built from its config (random weights; `torch.manual_seed` decides them)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = config(arch, preset, **overrides)
    _, model_cls = _classes(arch)
    return model_cls(cfg)


def _text_shape(batch_size: int, overrides: dict) -> tuple[int, int]:
    return batch_size, int(overrides.get("seq_len", 16))


def example_inputs(batch_size: int = 2, device: str | torch.device = "cpu", arch: str = "gpt2",
                   preset: str = "tiny", **overrides: Any) -> dict[str, torch.Tensor]:
    """Forward's keyword inputs for `batch_size` samples (zeros; on meta only the shapes)."""
    cfg = config(arch, preset, **overrides)
    if arch == "vit":
        return {"pixel_values": torch.zeros(batch_size, cfg.num_channels, cfg.image_size, cfg.image_size,
                                            device=device)}
    shape = _text_shape(batch_size, overrides)
    ids = torch.zeros(shape, dtype=torch.long, device=device)
    if arch == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids.clone()}
    return {"input_ids": ids}


def example_batch(batch_size: int, seed: int, arch: str = "gpt2", preset: str = "tiny",
                  **overrides: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A synthetic batch on the CPU, a pure function of `seed`: (keyword inputs, targets).

    Text: each row is an arithmetic progression of token ids modulo the vocabulary (random
    start and step per row), so the next token is predictable and the loss can fall. Causal
    LMs and T5 predict the next token (targets (B, T)); BERT sees 15% of its tokens replaced
    by id 0 and predicts the original ids (targets (B, T)). ViT: images whose class sets the
    mean brightness of one colour channel (targets (B,) class ids).
    """
    cfg = config(arch, preset, **overrides)
    g = torch.Generator().manual_seed(seed)
    if arch == "vit":
        labels = torch.randint(0, cfg.num_labels, (batch_size,), generator=g)
        x = torch.randn(batch_size, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g) * 0.5
        x[torch.arange(batch_size), labels % cfg.num_channels] += (labels.float() / cfg.num_labels)[:, None, None]
        return {"pixel_values": x}, labels
    b, t = _text_shape(batch_size, overrides)
    v = cfg.vocab_size
    start = torch.randint(0, v, (b, 1), generator=g)
    step = torch.randint(1, max(v, 2), (b, 1), generator=g)
    seq = (start + step * torch.arange(t + 1).unsqueeze(0)) % v          # (B, T+1)
    if arch == "bert":
        ids = seq[:, :-1].clone()
        masked = torch.rand(b, t, generator=g) < 0.15
        return {"input_ids": ids.masked_fill(masked, 0)}, seq[:, :-1].contiguous()
    if arch == "t5":
        return {"input_ids": seq[:, :-1].contiguous(), "decoder_input_ids": seq[:, :-1].contiguous()}, \
            seq[:, 1:].contiguous()
    return {"input_ids": seq[:, :-1].contiguous()}, seq[:, 1:].contiguous()
