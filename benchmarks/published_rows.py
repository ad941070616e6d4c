"""The measured runs of docs/reference/PUBLISHED.md (the public calibration set) as data, for benchmarks/published_runs.py.

One `Run` per published row: which model (an examples/models/gpt.py preset), how many GPUs,
the global batch, the parallel knobs the source publishes (ParallelConfig fields), the
published figure and its unit, and the software stack it ran on. Knobs a source does not
publish are named in `Run.searched`: planner.optimize chooses them with the published knobs
pinned. A stack maps to Evaluator options in one place, `evaluator_options`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Mapping

from cost_models.hardware import Cluster, Link
from cost_models.overlap import Overlap
from runtime.vocab import DType


class Unit(StrEnum):
    """The unit a source publishes its figure in."""

    TFLOPS = "TFLOP/s per GPU"
    SECONDS = "s/iteration"


class Stack(StrEnum):
    """The training software a run used; `evaluator_options` says what each means to the cost model."""

    MEGATRON_2021 = "megatron-2021"
    DEEPSPEED = "deepspeed"
    MEGATRON_DEEPSPEED = "megatron-deepspeed"
    FSDP = "fsdp"
    MEGATRON = "megatron"


class Partition(StrEnum):
    """How a published pipeline run cut the layers into stages."""

    # Megatron-LM: every stage the same number of transformer blocks; the embedding rides on
    # the first stage, the output layer on the last.
    MEGATRON = "megatron"
    # Megatron-DeepSpeed `--pp-partition-method type:transformer|embedding` (BLOOM's slurm
    # script): the embedding and the (tied) output layer each count as one block.
    EMBEDDING_AS_BLOCK = "transformer|embedding"
    # not published: the planner balances the stages
    PLANNER = "planner"


# Evaluator options per stack, from the facts each source states: attention fused or not, and
# what the stack overlaps (cost_models/overlap.py; its presets cite their sources).
_STACK_OPTIONS: Mapping[Stack, Mapping[str, Any]] = MappingProxyType({
    # Megatron-LM SC'21, section 5 and its 2021 code: attention scores materialized (no flash
    # attention), fp32 main gradients all-reduced after the pipeline flush.
    Stack.MEGATRON_2021: MappingProxyType(dict(fused_attention=False, overlap=Overlap.preset("megatron-2021"))),
    # DeepSpeed ZeRO-3 as SC'21 Table 2 ran it (2021): unfused attention; fp16 gradients
    # reduce-scattered while the backward runs, parameters prefetched.
    # DeepSpeed's defaults bound what ZeRO-3 holds gathered: stage3_max_live_parameters 1e9
    # (deepspeed/runtime/zero/config.py), besides the prefetch bound the overlap preset states.
    Stack.DEEPSPEED: MappingProxyType(dict(fused_attention=False, overlap=Overlap.preset("deepspeed"),
                                           zero3_live_parameters=1e9)),
    # Megatron-DeepSpeed (BLOOM, 2022): unfused attention (a fused softmax kernel, the scores
    # still materialized); its bf16 optimizer keeps and all-reduces fp32 gradients after the
    # pipeline flush (DeepSpeed's pipeline engine reduces once all micro-batches are done), and
    # ZeRO-1 gathers the updated weights inside the optimizer step.
    Stack.MEGATRON_DEEPSPEED: MappingProxyType(dict(fused_attention=False, overlap=dataclasses.replace(
        Overlap.preset("deepspeed"), grad_reduce=False, param_gather=False, grad_reduce_dtype=DType.FP32))),
    # metaseq FSDP (OPT, 2022): unfused attention; FSDP prefetches the next layer's parameters and
    # reduce-scatters fp16 gradients while the backward runs, the overlap torchtitan's FSDP preset
    # describes.
    Stack.FSDP: MappingProxyType(dict(fused_attention=False, overlap=Overlap.preset("torchtitan"))),
    # Megatron-LM as of 2023 (MegaScale's baseline): flash attention; gradients reduced in fp32
    # (Megatron-LM arguments.py turns accumulate_allreduce_grads_in_fp32 on for bf16). MegaScale
    # section 3.3 presents the overlap of all three kinds of communication as its own addition:
    # data-parallel all-gathers prefetched and reduce-scatters under the last micro-batch's
    # backward, pipeline sends decoupled from receives, tensor-parallel collectives fused with
    # the GEMMs. The baseline is taken without any of them (Megatron-Core's own
    # --overlap-grad-reduce and --overlap-param-gather came in late 2023). The strong-scaling
    # ratios of section 6.1 are the check: exposed data-parallel traffic is what falls per GPU
    # as the same batch spreads wider (published_runs.py prints them).
    Stack.MEGATRON: MappingProxyType(dict(fused_attention=True, overlap=dataclasses.replace(
        Overlap.preset("megatron"), tp_comm=0.0, grad_reduce=False, param_gather=False, p2p=False,
        grad_reduce_dtype=DType.FP32))),
})


# The dimensions a stack could not run when its rows were measured, pinned off where the search
# chooses a row's unpublished knobs: sequence parallelism came with Megatron-LM v3 (2022,
# Korthikanti et al.) and reached neither DeepSpeed ZeRO-3 of 2021, Megatron-DeepSpeed's BLOOM
# run nor metaseq's FSDP; context parallelism came to Megatron-Core in 2024, after MegaScale.
_STACK_LACKS: Mapping[Stack, Mapping[str, Any]] = MappingProxyType({
    Stack.MEGATRON_2021: MappingProxyType(dict(sequence_parallel=False, context=1)),
    Stack.DEEPSPEED: MappingProxyType(dict(sequence_parallel=False, context=1)),
    Stack.MEGATRON_DEEPSPEED: MappingProxyType(dict(sequence_parallel=False, context=1)),
    Stack.FSDP: MappingProxyType(dict(sequence_parallel=False, context=1)),
    Stack.MEGATRON: MappingProxyType(dict(context=1)),
})


def stack_constraints(stack: Stack | str) -> dict[str, Any]:
    """Search constraints that keep the search to what `stack` could run (see _STACK_LACKS)."""
    return dict(_STACK_LACKS[Stack(stack)])


def evaluator_options(stack: Stack | str) -> dict[str, Any]:
    """Keyword arguments of planner.Evaluator (and planner.optimize) describing `stack`."""
    return dict(_STACK_OPTIONS[Stack(stack)])


class ClusterName(StrEnum):
    """The clusters the runs ran on."""

    DGX_A100 = "dgx-a100-80gb"
    # Jean Zay's A100 partition (BLOOM): 8 A100 80GB per node as in a DGX A100, but the
    # network is 4 x 100 Gb/s Omni-Path per node (PUBLISHED.md, BLOOM row).
    JEAN_ZAY = "jean-zay-a100"


# PUBLISHED.md, BLOOM row: 4 x 100 Gb/s Omni-Path per node = 50e9 B/s per node, 6.25e9 B/s per
# GPU (the presets give the inter-node link per device). Latency as the InfiniBand presets
# assume (cost_models/presets.py).
_JEAN_ZAY_GPU_BANDWIDTH = 4 * 100e9 / 8 / 8


def cluster_for(name: ClusterName | str, gpus: int) -> Cluster:
    """`gpus` GPUs (whole 8-GPU nodes) of the named cluster."""
    base = Cluster.preset(ClusterName.DGX_A100.value, nodes=gpus // 8)
    if ClusterName(name) == ClusterName.DGX_A100:
        return base
    return dataclasses.replace(
        base, name=f"jean-zay-a100 ({gpus // 8} nodes)",
        inter_node=Link(bandwidth=_JEAN_ZAY_GPU_BANDWIDTH, latency=base.inter_node.latency),
        source="dgx-a100-80gb node with Jean Zay's network: 4 x 100 Gb/s Omni-Path per node "
               "(PUBLISHED.md, BLOOM-176B row)")


class Table(StrEnum):
    """The tables of PUBLISHED.md."""

    SC21 = "Megatron-LM SC'21 Table 2"
    MORE = "More measured runs"


@dataclass(frozen=True)
class Run:
    """One published measured run.

    name: the run as PUBLISHED.md names it (Table 2: the scheme); model: a gpt.py preset;
    gpus: devices; batch: global batch (sequences); knobs: the published ParallelConfig fields;
    searched: ParallelConfig fields the source leaves unpublished (chosen by planner.optimize);
    published: the figure, in `unit`; dropout: the model's dropout probability.
    """

    table: Table
    name: str
    source: str
    model: str
    gpus: int
    batch: int
    knobs: tuple[tuple[str, Any], ...]
    published: float
    unit: Unit
    stack: Stack
    cluster: ClusterName = ClusterName.DGX_A100
    partition: Partition = Partition.PLANNER
    searched: tuple[str, ...] = ()
    dropout: float = 0.1

    @property
    def label(self) -> str:
        """Short row label, e.g. "PTD-P 384" or "MegaScale 3072"."""
        return f"{self.name} {self.gpus}"


# Table 2's models (PUBLISHED.md: 174.6B and 529.6B parameters as the paper counts them)
SC21_PRESETS = MappingProxyType({174.6: "gpt3-175b", 529.6: "megatron-530b"})
_SC21 = "Narayanan et al., SC'21 (arXiv 2104.04473), Table 2"

# scheme, params (B), model-parallel size, global batch, GPUs, micro-batch, published TFLOP/s per GPU
_SC21_ROWS = (
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
)


def _sc21(scheme: str, params: float, mp: int, batch: int, gpus: int, mb: int, tflops: float) -> Run:
    common = dict(micro_batch_size=mb, recompute="full", dtype="fp16")
    if scheme == "ZeRO-3":
        knobs, stack, partition = dict(data=gpus, zero=3, **common), Stack.DEEPSPEED, Partition.PLANNER
    else:   # PTD-P: tensor 8 and pipeline = model-parallel size / 8 (PUBLISHED.md)
        knobs = dict(data=gpus // mp, tensor=8, pipeline=mp // 8, schedule="1f1b", **common)
        stack, partition = Stack.MEGATRON_2021, Partition.MEGATRON
    return Run(Table.SC21, scheme, _SC21, SC21_PRESETS[params], gpus, batch, tuple(knobs.items()), tflops,
               Unit.TFLOPS, stack, partition=partition)


_MEGASCALE = "MegaScale (NSDI'24, arXiv 2402.15627) Table 2, Table 1, section 6.1"
# GPUs, data degree, global batch, published s/iteration (PUBLISHED.md, the two MegaScale rows)
_MEGASCALE_ROWS = (
    (256, 4, 768, 40.0), (512, 8, 768, 21.2), (768, 12, 768, 15.2), (1024, 16, 768, 11.9),
    (3072, 48, 6144, 29.02), (6144, 96, 6144, 14.78), (8192, 128, 6144, 12.24), (12288, 192, 6144, 8.57),
)
MEGASCALE_NAME = "MegaScale, Megatron-LM baseline"


def _megascale(gpus: int, data: int, batch: int, seconds: float) -> Run:
    # "interleaved, 6 stages": the interleaved 1F1B schedule with 6 model chunks per pipeline
    # rank (96 layers / (8 x 6) = 2 blocks per chunk). dtype not published: bf16 (the same
    # A100 peak as fp16). Micro-batch, recompute and ZeRO stage not published: searched.
    knobs = dict(data=data, tensor=8, pipeline=8, schedule="interleaved", virtual_stages=6, dtype="bf16")
    return Run(Table.MORE, MEGASCALE_NAME, _MEGASCALE, "megascale-175b", gpus, batch, tuple(knobs.items()),
               seconds, Unit.SECONDS, Stack.MEGATRON, searched=("micro_batch_size", "recompute", "zero"))


RUNS: tuple[Run, ...] = (
    *(_sc21(*row) for row in _SC21_ROWS),
    Run(Table.MORE, "Megatron-LM GPT-3 example",
        "NVIDIA/Megatron-LM README \"GPT-3 Example\" + examples/pretrain_gpt3_175B.sh", "gpt3-175b", 1024, 1536,
        tuple(dict(data=8, tensor=8, pipeline=16, micro_batch_size=1, schedule="1f1b", recompute="full",
                   dtype="fp16").items()),
        32.0, Unit.SECONDS, Stack.MEGATRON_2021, partition=Partition.MEGATRON),
    # BLOOM: dropout 0 (hidden and attention dropout 0.0 in the tr11 slurm script)
    Run(Table.MORE, "BLOOM-176B",
        "bigscience-workshop/bigscience train/tr11-176B-ml README (iteration 85376) and its slurm script",
        "bloom-176b", 384, 2048,
        tuple(dict(data=8, tensor=4, pipeline=12, micro_batch_size=2, schedule="1f1b", recompute="full",
                   zero=1, dtype="bf16").items()),
        104.70, Unit.SECONDS, Stack.MEGATRON_DEEPSPEED, cluster=ClusterName.JEAN_ZAY,
        partition=Partition.EMBEDDING_AS_BLOCK, dropout=0.0),
    # OPT: "about 2M tokens" per batch; 992 sequences of 2048 tokens (2,031,616 tokens) is the
    # batch nearest 2M that the 124 data ranks divide (8 sequences each).
    Run(Table.MORE, "OPT-175B", "OPT paper (arXiv 2205.01068) section 2.4", "opt-175b", 992, 992,
        tuple(dict(data=124, tensor=8, pipeline=1, zero=3, dtype="fp16").items()),
        147.0, Unit.TFLOPS, Stack.FSDP, searched=("micro_batch_size", "recompute")),
    *(_megascale(*row) for row in _MEGASCALE_ROWS),
)


def paper_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one step as Megatron-LM SC'21 counts them (PUBLISHED.md): GEMMs only, the
    recomputed forward included, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    s, l, h, v = seq, layers, hidden, vocab
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def per_gpu_scaling(seconds_small: float, gpus_small: int, seconds_large: float, gpus_large: int) -> float:
    """Per-GPU throughput kept when the same batch spreads from `gpus_small` to `gpus_large` GPUs:
    (seconds_small x gpus_small) / (seconds_large x gpus_large); 1.0 is perfect strong scaling."""
    return (seconds_small * gpus_small) / (seconds_large * gpus_large)
