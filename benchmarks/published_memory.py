"""Predicted peak memory per GPU against every measured figure we found published.

Each row is a run whose source states the memory one GPU used, with the configuration it
ran (model, GPUs, parallel degrees, micro-batch, recompute, dtype); the row is evaluated on
the matching preset with the stack's facts (attention fused or not, gradient width) and
the predicted peak (allocated bytes plus the allocator's fragmentation margin) is printed
next to the published figure. Nothing here is fitted to these rows.

    python benchmarks/published_memory.py            # every row (captures 8B-176B models on meta: minutes)
    python benchmarks/published_memory.py --rows 1   # the first row only

Caveats are stated in each row's note: the models are meshplan's captures (the example GPT,
transformers' Llama) standing in for each stack's own code; each row is priced with its stack's
selective recomputation policy (cost_models/activations.SelectivePolicy).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.activations import SelectivePolicy  # noqa: E402
from cost_models.overlap import Overlap  # noqa: E402

GiB = 2**30
GB = 1e9

# name -> (builder module, build kwargs, example-input kwargs): one sample each
LLAMA31_8B = dict(arch="llama", preset="llama-7b", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                  seq_len=8192)
MODELS = MappingProxyType({
    # Llama 3.1 8B and 70B (Llama 3 paper, arXiv 2407.21783, Table 3) at torchtitan's 8192 tokens
    "llama3.1-8b": ("hf", LLAMA31_8B),
    "llama3.1-70b": ("hf", {**LLAMA31_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                            "intermediate_size": 28672}),
    # BLOOM-176B's shape (h 14336, 70 layers, 112 heads, vocabulary 250880, 2048 tokens) as the example GPT
    # (learned positions in place of ALiBi; an untied output layer, which Megatron's pipeline also
    # holds as a second copy on the last stage)
    "bloom-176b": ("gpt", dict(vocab_size=250880, seq_len=2048, hidden=14336, num_layers=70, num_heads=112,
                               dropout=0.0)),
})


@dataclass(frozen=True)
class MemoryRow:
    """One published run: what it ran and the memory one GPU used (`published` bytes, `measure` says
    which figure: torch's max reserved, or a stated round figure)."""

    run: str
    source: str
    model: str
    cluster: str
    gpus: int
    config: dict[str, Any]
    global_batch_size: int
    published: float
    measure: str
    note: str
    evaluator: dict[str, Any] = field(default_factory=dict)
    device_memory: float | None = None   # bytes per GPU where the run's GPUs hold other than the preset's


TORCHTITAN_8B = MemoryRow(
    run="Llama 3.1 8B, torchtitan FSDP, 8 GPUs",
    source="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (row FSDP)",
    model="llama3.1-8b", cluster="dgx-h100", gpus=8,
    config=dict(data=8, zero=3, micro_batch_size=2, recompute="selective", dtype="bf16"),
    global_batch_size=16, published=82.4 * GiB, measure="max reserved",
    note="torchtitan's selective op AC (llama3_8b.toml: selective_ac_option 'op'), priced as such: a block keeps "
         "its input, the attention output and every other matmul's output; H100 96 GB HBM2e",
    # FSDP2 with a bf16 param_dtype: 16-bit weights gathered a layer at a time, fp32 shards and optimizer state
    evaluator=dict(overlap=Overlap.preset("torchtitan"), selective=SelectivePolicy.ALTERNATE_MATMULS),
    device_memory=96 * GB,   # the benchmark's Grand Teton H100s: "96GB HBM2e"
)

ROWS: tuple[MemoryRow, ...] = (
    MemoryRow(
        run="BLOOM-176B, Megatron-DeepSpeed",
        source="BigScience 176B model card (bigscience.notion.site BigScience-176B-Model; huggingface.co/"
               "bigscience/tr11-176B-logs README): 'one copy of the model takes 48 GPUs (using 60 GB of "
               "memory on each GPU)'; configuration from PUBLISHED.md (tr11-176B-ml slurm script)",
        model="bloom-176b", cluster="dgx-a100-80gb", gpus=384,
        config=dict(data=8, tensor=4, pipeline=12, micro_batch_size=2, zero=1, recompute="full", dtype="bf16"),
        global_batch_size=2048, published=60 * GB, measure="stated (about)",
        note="scores materialized (Megatron's fused softmax); DeepSpeed's bf16 optimizer keeps fp32 gradients",
        evaluator=dict(fused_attention=False, grad_reduce_bytes=4, overlap_grad_reduce=False,
                       overlap=Overlap.preset("deepspeed")),   # 16-bit weights and activations (no autocast)
    ),
    TORCHTITAN_8B,
    replace(TORCHTITAN_8B, run="Llama 3.1 8B, torchtitan FSDP, 128 GPUs", gpus=128,
            source="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 3 (row FSDP)",
            config={**TORCHTITAN_8B.config, "data": 128}, global_batch_size=256, published=67.0 * GiB),
    MemoryRow(
        run="Llama 3.1 70B, torchtitan FSDP 32 + TP 8",
        source="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4 (row 2D)",
        model="llama3.1-70b", cluster="dgx-h100", gpus=256,
        config=dict(data=32, tensor=8, sequence_parallel=True, zero=3, micro_batch_size=16, recompute="full",
                    dtype="bf16"),
        global_batch_size=512, published=71.9 * GiB, measure="max reserved",
        note="Float8 linears and torch.compile (the model prices bf16); torchtitan's TP is sequence-parallel",
        evaluator=dict(overlap=Overlap.preset("torchtitan")),
        device_memory=96 * GB,
    ),
)


def graph_of(name: str):
    """The captured graph of MODELS[name] for one sample, on meta."""
    import torch

    import planner
    from examples.models import gpt, hf

    kind, kw = MODELS[name]
    if kind == "hf":
        with torch.device("meta"):
            model = hf.build(**kw)
        return planner.capture(model, hf.example_inputs(batch_size=1, device="meta", **kw))
    with torch.device("meta"):
        model = gpt.build(**kw)
    return planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", **kw))


def cluster_of(row: MemoryRow):
    """The row's cluster: whole nodes of its preset."""
    from cost_models.hardware import Cluster

    per_node = Cluster.preset(row.cluster).devices_per_node
    if row.gpus % per_node:
        raise ValueError(f"{row.run}: {row.gpus} GPUs is not a whole number of {row.cluster} nodes")
    return Cluster.preset(row.cluster, nodes=row.gpus // per_node)


def config_of(row: MemoryRow):
    """The row's ParallelConfig; ValueError naming the row when its degrees do not multiply to its GPUs."""
    from planner import ParallelConfig

    config = ParallelConfig(**row.config)
    if config.num_devices != row.gpus:
        raise ValueError(f"{row.run}: the degrees multiply to {config.num_devices} devices, not {row.gpus}")
    return config


def main(argv: list[str] | None = None) -> int:
    from planner.evaluator import Evaluator

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=len(ROWS), help="evaluate the first N rows")
    args = ap.parse_args(argv)
    graphs: dict[str, Any] = {}
    print(f"{'run':<42} {'config':<30} {'published':>10} {'predicted':>10} {'error':>7}  (GiB)")
    for row in ROWS[:args.rows]:
        t0 = time.perf_counter()
        if row.model not in graphs:
            graphs[row.model] = graph_of(row.model)
        config = config_of(row)
        ev = Evaluator(graphs[row.model], cluster_of(row), **row.evaluator)
        pred = ev.evaluate(config, row.global_batch_size)
        # the same run under each recompute mode: where the published figure falls when a stack's policy
        # is not one of the model's
        modes = {rc: ev.evaluate(replace(config, recompute=rc), row.global_batch_size).peak_memory / GiB
                 for rc in ("none", "selective", "full")}
        err = (pred.peak_memory - row.published) / row.published
        m = pred.memory
        print(f"{row.run:<42} {config.short():<30} {row.published / GiB:>10.1f} {pred.peak_memory / GiB:>10.1f} "
              f"{err:>+7.1%}  ({time.perf_counter() - t0:.0f} s)")
        print(f"    predicted: weights {m.parameters / GiB:.1f}, gradients {m.gradients / GiB:.1f}, optimizer "
              f"{m.optimizer / GiB:.1f}, activations {m.activations / GiB:.1f}, buffers {m.comm_buffers / GiB:.1f}, "
              f"temporary {m.temporary / GiB:.1f}, fragmentation {m.fragmentation / GiB:.1f}")
        print("    by recompute mode: " + ", ".join(f"{rc} {gib:.1f}" for rc, gib in modes.items()))
        memory = row.device_memory or cluster_of(row).device.memory_bytes
        print(f"    fits its GPUs ({memory / GiB:.1f} GiB): {'yes' if pred.peak_memory <= memory else 'NO'}")
        print(f"    published ({row.measure}): {row.source}")
        print(f"    note: {row.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
