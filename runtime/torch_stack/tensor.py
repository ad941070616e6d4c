"""Tensor (and sequence) parallelism by module path: torch's parallel styles from a layout's
`tensor` entries (see vocab.TensorStyle), applied with parallelize_module over the tensor mesh.

Under sequence parallelism (Korthikanti et al. 2022, section 4.2.2) the activations between regions
are split along `sequence_dim`: columns take that split input (all-gathered), rows and vocabulary
embeddings give it (reduce-scattered). Inside a region every style hands the model's code a local
torch.Tensor (a rank's features, its heads); between regions under sequence parallelism the
activations stay DTensors placed Shard(sequence_dim), so the model's code between regions (residual
adds, a norm, `hidden_states.shape`) sees the whole sequence's shape while each rank holds its tokens.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from runtime.torch_stack.vocab import TensorStyle


class TieMismatch(ValueError):
    """Tied parameters ended up split differently; the message names them."""


class StridedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a fused projection whose output features are `groups` equal parts (q, k, v),
    each split into contiguous blocks: rank r of t holds block r of every part. The weight (and bias)
    is a DTensor placed _StridedShard(0, split_factor=groups), which means exactly that; the local output
    holds the same blocks (B, T, groups * features / (groups * t)), handed over as a local tensor."""

    def __init__(self, groups: int, **kwargs):
        super().__init__(**kwargs)
        self.groups = groups

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            placed = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.groups)],
                                       src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(placed))

    def _partition_embedding_fn(self, name, module, device_mesh):
        raise ValueError(f"module {name!r}: a strided column split applies to an nn.Linear, not an nn.Embedding")

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        # the output is placed _StridedShard on its last dimension: exactly the blocks the model reads
        return outputs.to_local()


def style_of(entry: dict, sequence_dim: int | None) -> ParallelStyle:
    """torch's ParallelStyle for one layout entry {"path", "style", "groups", "dim"}; `dim` of a tensor
    style is the sequence dimension split at its input (columns) or output (rows, embeddings)."""
    style = TensorStyle(entry["style"])
    dim = entry["dim"]
    seq = Replicate() if dim is None else Shard(int(dim))
    if style is TensorStyle.COLWISE:
        return ColwiseParallel(input_layouts=seq)
    if style is TensorStyle.COLWISE_STRIDED:
        return StridedColwiseParallel(int(entry["groups"]), input_layouts=seq)
    if style is TensorStyle.OUTPUT_COLWISE:
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if style in (TensorStyle.ROWWISE, TensorStyle.EMBEDDING_ROWWISE):
        return RowwiseParallel(input_layouts=Shard(-1) if style is TensorStyle.ROWWISE else Replicate(),
                               output_layouts=seq, use_local_output=dim is None)
    if style is TensorStyle.SEQUENCE:
        return SequenceParallel(sequence_dim=sequence_dim)
    if style is TensorStyle.SEQUENCE_SCATTER:
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=False)
    return PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate(), use_local_output=True)


def apply_tensor(model: nn.Module, layout: dict, tp_mesh: DeviceMesh | None) -> nn.Module:
    """Split `model` in place over `tp_mesh` as the layout's `tensor` entries say, then tie its tied
    parameters again (a style replaces a module's parameters with DTensors, which unties them)."""
    sequence_dim = layout.get("sequence_dim")
    plan = {e["path"]: style_of(e, sequence_dim) for e in layout["tensor"]}
    if plan:
        parallelize_module(model, tp_mesh, plan)
    retie(model, layout.get("ties", ()))
    return model


def retie(model: nn.Module, ties) -> None:
    """Make every group of tied parameter names one parameter again: the split one (a DTensor) where a
    style split any, all split members having the same placements; TieMismatch otherwise."""
    for names in ties:
        owners = [(model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in names]
        params = [getattr(m, attr) for m, attr in owners]
        split = [(n, p) for n, p in zip(names, params) if isinstance(p, DTensor)]
        if not split:
            continue
        keep_name, keep = split[0]
        for n, p in split[1:]:
            if p.placements != keep.placements:
                raise TieMismatch(f"tied parameters {keep_name!r} ({keep.placements}) and {n!r} ({p.placements}) "
                                  f"are split differently; give their modules matching styles")
        for module, attr in owners:
            if getattr(module, attr) is not keep:
                setattr(module, attr, keep)
