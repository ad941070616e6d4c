"""clip_grad_norm_ over a parallelized model's gradients, correct whatever mesh each one lives on.

torch.nn.utils.clip_grad_norm_ stacks the per-parameter norms, which fails when the gradients are
DTensors on different meshes (a tensor-parallel weight on (data, tensor), a norm's weight on data only,
a plain tensor beside them). Here each gradient contributes the p-th power of its local shard's norm
(the max for p = inf), gradients with the same mesh and placements are summed locally, and the sum is
reduced over exactly the mesh dimensions that shard them (a replicated dimension holds copies and is
not summed). A gradient still Partial over a dimension (a sequence-parallel norm's weight: every rank
holds its tokens' share) is summed over it first. The total norm equals the single-process norm of
the whole gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard


def _is_split(placement) -> bool:
    """Whether a mesh dimension holds different parts of the tensor (Shard, _StridedShard) rather than
    copies (Replicate); _StridedShard does not answer is_shard()."""
    return placement.is_shard() or isinstance(placement, _StridedShard)


def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of all `grads` together (a 0-dim float32 tensor, the same on every rank)."""
    inf = math.isinf(norm_type)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g.to_local() if isinstance(g, DTensor) else g)
    parts = []
    for key, locals_ in groups.items():
        norms = torch.stack([torch.linalg.vector_norm(t.detach().float(), norm_type) for t in locals_])
        part = norms.max() if inf else norms.pow(norm_type).sum()
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if _is_split(placement):
                    dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                                    group=mesh.get_group(dim))
        parts.append(part)
    if not parts:
        return torch.zeros(())
    stacked = torch.stack([p.cpu() for p in parts])
    return stacked.max() if inf else stacked.sum().pow(1.0 / norm_type)


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    eps: float = 1e-6) -> torch.Tensor:
    """Scale the gradients in place so that their total norm is at most `max_norm` (torch's rule:
    factor max_norm / (norm + eps), clamped to 1); returns the norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads, float(norm_type))
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device, local.dtype))
    return norm
