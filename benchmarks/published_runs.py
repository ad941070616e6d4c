"""Check the cost model against Megatron-LM SC'21 Table 2 (shared/reference/PUBLISHED.md).

For each of the twelve runs (GPT 174.6B and 529.6B; ZeRO-3 and PTD-P) the
published configuration is evaluated on the dgx-a100-80gb preset with the
default (published-fact) efficiencies; nothing here is fitted to these rows.
Facts of those runs are stated, not fitted: the model uses dropout 0.1,
attention was unfused (the scores are materialized), gradients were
all-reduced in fp32 after the pipeline flush, and every stage held the same
number of layers.
Predicted TFLOP/s per GPU uses the paper's own FLOP formula, so the counting
convention matches:  F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)),
TFLOP/s per GPU = F / (step time x GPUs).

    python benchmarks/published_runs.py

Target (issue 3): median absolute error <= 10%, every row within 20%.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import planner  # noqa: E402
from examples.models import gpt  # noqa: E402
from cost_models.overlap import Overlap  # noqa: E402
from planner.evaluate import Evaluator  # noqa: E402

# scheme, params (B), model-parallel size, global batch, GPUs, micro-batch, published TFLOP/s per GPU
ROWS = [
    ("ZeRO-3", 174.6, 1, 1536, 384, 4, 144),
    ("ZeRO-3", 174.6, 1, 1536, 768, 2, 88),
    ("ZeRO-3", 174.6, 1, 1536, 1536, 1, 44),
    ("ZeRO-3", 529.6, 1, 2560, 640, 4, 138),
    ("ZeRO-3", 529.6, 1, 2240, 1120, 2, 98),
    ("ZeRO-3", 529.6, 1, 2240, 2240, 1, 48),
    ("PTD-P", 174.6, 96, 1536, 384, 1, 153),
    ("PTD-P", 174.6, 96, 1536, 768, 1, 149),
    ("PTD-P", 174.6, 96, 1536, 1536, 1, 141),
    ("PTD-P", 529.6, 280, 2240, 560, 1, 171),
    ("PTD-P", 529.6, 280, 2240, 1120, 1, 167),
    ("PTD-P", 529.6, 280, 2240, 2240, 1, 159),
]
PRESET = {174.6: "gpt3-175b", 529.6: "megatron-530b"}


def paper_flops(batch: int, cfg) -> float:
    s, l, h, v = cfg.seq_len, cfg.num_layers, cfg.hidden, cfg.vocab_size
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def config_for(scheme: str, mp: int, gpus: int, mb: int, graph) -> planner.ParallelConfig:
    if scheme == "ZeRO-3":
        return planner.ParallelConfig(data=gpus, micro_batch_size=mb, zero=3, recompute="full", dtype="fp16")
    t, p = 8, mp // 8
    # Megatron gives every stage the same number of transformer layers (the
    # embedding rides on the first stage, the output layer on the last).
    blocks = [layer.name for layer in graph.layers if layer.name.startswith("blocks.")]
    per = len(blocks) // p
    boundaries = tuple(blocks[k * per] for k in range(1, p))
    return planner.ParallelConfig(data=gpus // mp, tensor=t, pipeline=p, micro_batch_size=mb,
                                  schedule="1f1b", recompute="full", dtype="fp16",
                                  stage_boundaries=boundaries)


def main() -> int:
    graphs = {}
    for size, preset in PRESET.items():
        with torch.device("meta"):  # the paper's GPT: dropout 0.1 on attention and hidden states
            model = gpt.build(preset=preset, dropout=0.1)
        graphs[size] = (planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset=preset)),
                        gpt.make_config(preset))
    print(f"{'scheme':<7} {'params':>7} {'GPUs':>5} {'config':<34} {'pred TF/s':>9} {'published':>9} {'error':>7}"
          f" {'fits':>5} {'eval ms':>8}")
    errors = []
    for scheme, size, mp, batch, gpus, mb, published in ROWS:
        graph, cfg = graphs[size]
        cluster = planner.Cluster.preset("dgx-a100-80gb", nodes=gpus // 8)
        config = config_for(scheme, mp, gpus, mb, graph)
        # Facts of the 2021 runs: attention scores materialized (no flash attention);
        # Megatron all-reduced fp32 main gradients after the pipeline flush (the megatron-2021
        # overlap); DeepSpeed ZeRO-3 reduce-scattered fp16 gradients with overlap_comm and
        # prefetched its parameter gathers (the deepspeed overlap).
        stack = "megatron-2021" if scheme == "PTD-P" else "deepspeed"
        ev = Evaluator(graph, cluster, fused_attention=False, overlap=Overlap.preset(stack))
        t0 = time.perf_counter()
        pred = ev.evaluate(config, batch)
        ms = (time.perf_counter() - t0) * 1e3
        tflops = paper_flops(batch, cfg) / (pred.step_time * gpus) / 1e12
        err = (tflops - published) / published
        errors.append(abs(err))
        print(f"{scheme:<7} {size:>6}B {gpus:>5} {config.short():<34} {tflops:>9.1f} {published:>9} "
              f"{err:>+7.1%} {str(pred.fits):>5} {ms:>8.1f}")
    med, worst = statistics.median(errors), max(errors)
    print(f"\nmedian absolute error {med:.1%}, worst {worst:.1%} "
          f"(target: median <= 10%, every row <= 20%): {'met' if med <= 0.10 and worst <= 0.20 else 'MISSED'}")
    return 0 if med <= 0.10 and worst <= 0.20 else 1


if __name__ == "__main__":
    sys.exit(main())
