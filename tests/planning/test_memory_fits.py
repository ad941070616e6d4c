"""A configuration published as run fits in the predicted memory: GPT-175B on 384 A100 80GB with
tensor 8, pipeline 12, data 4, micro-batch 1 and full recomputation (Megatron-LM SC'21, Narayanan
et al., Table 2, PTD-P row; docs/reference/PUBLISHED.md), priced with the facts of that run
(scores materialized, fp32 main gradients, dropout 0.1, 8 blocks per stage)."""

from __future__ import annotations

import pytest
import torch

import planner
from cost_models.overlap import Overlap
from examples.models import gpt
from planner.evaluator import Evaluator

S, H, A, T, P = 2048, 12288, 96, 8, 12
SBH = S * 1 * H   # one sequence per micro-batch


@pytest.fixture(scope="module")
def gpt175b():
    with torch.device("meta"):
        model = gpt.build(preset="gpt3-175b", dropout=0.1)
    return planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset="gpt3-175b"))


def test_gpt175b_ptdp_row_fits_on_a100_80gb(gpt175b):
    blocks = [layer.name for layer in gpt175b.layers if layer.name.startswith("blocks.")]
    config = planner.ParallelConfig(data=4, tensor=T, pipeline=P, micro_batch_size=1, schedule="1f1b",
                                    recompute="full", dtype="fp16",
                                    stage_boundaries=tuple(blocks[k * 8] for k in range(1, P)))
    cluster = planner.Cluster.preset("dgx-a100-80gb", nodes=48)
    # Megatron-LM's stack: 16-bit weights and activations, no autocast (cost_models/overlap.py)
    ev = Evaluator(gpt175b, cluster, fused_attention=False, overlap_grad_reduce=False, grad_reduce_bytes=4,
                   overlap=Overlap.preset("megatron-2021"))
    pred = ev.evaluate(config, global_batch_size=1536)
    assert pred.fits and pred.peak_memory < 80 * 2**30
    # Stage 0 (the embedding dropout and blocks 0-7) holds 12 micro-batches under 1F1B (p - 0, 384 of them
    # per step): each keeps every layer's input, 2 s b h bytes in fp16 (the token ids feeding the embedding
    # are 2048 int64, scaled as the captured fp32 input, 8 KiB); one block's backward rebuilds
    # s b h (10 + 24/t + 5 a s / (h t)) + 16 s b (Korthikanti et al. 2022 eq. 2 and the LayerNorm statistics).
    kept = 9 * 2 * SBH + 2048 * 8 * 2 / 4
    working = SBH * (10 + 24 / T + 5 * A * S / (H * T)) + 16 * S
    stage0 = pred.stages[0].memory
    assert stage0.activations == pytest.approx(12 * kept + working)
