"""Data parallelism over the data mesh: torch's FSDP-based `replicate`
(torch.distributed._composable.replicate_with_fsdp; ZeRO 0: parameters and optimizer state whole,
gradients all-reduced and averaged over the data ranks; built on FSDP2's parameter handling, it takes
the DTensor parameters tensor parallelism leaves, so data x tensor composes) or FSDP2's
`fully_shard` on every block, then the root (ZeRO 3 reshards after forward; ZeRO 1 and 2 keep the
gathered parameters until backward)."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from runtime.torch_stack.vocab import DataKind


def apply_data(model: nn.Module, layout: dict, dp_mesh: DeviceMesh | None) -> nn.Module:
    """Wrap `model` (in place) over `dp_mesh` as the layout's `data` entry says."""
    data = layout["data"]
    kind = DataKind(data["kind"])
    if kind is DataKind.NONE:
        return model
    if kind is DataKind.REPLICATE:
        replicate(model, mesh=dp_mesh)
        return model
    reshard = bool(data["reshard_after_forward"])
    for path in data["units"]:
        fully_shard(model.get_submodule(path), mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    return model
