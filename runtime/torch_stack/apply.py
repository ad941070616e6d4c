"""A torch layout applied to a model, in torch's order: tensor (and sequence) parallel styles, then
activation checkpointing, then the data-parallel wrapper (fully_shard must see the final modules)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from runtime.torch_stack.data import apply_data
from runtime.torch_stack.recompute import apply_recompute
from runtime.torch_stack.tensor import apply_tensor


def apply_layout(model: nn.Module, layout: dict, mesh: DeviceMesh) -> nn.Module:
    """Parallelize `model` in place as the layout dict says over `mesh` (its dimensions named by axis)."""
    names = mesh.mesh_dim_names or ()
    apply_tensor(model, layout, mesh["tensor"] if "tensor" in names else None)
    apply_recompute(model, layout)
    apply_data(model, layout, mesh["data"] if "data" in names else None)
    return model
