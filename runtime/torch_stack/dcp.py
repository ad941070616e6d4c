"""Distributed Checkpoint (torch.distributed.checkpoint) for a parallelized model and its optimizer.

The state dicts come from torch.distributed.checkpoint.state_dict (get_state_dict / set_state_dict):
parameters and optimizer state as DTensors under their canonical names (wrapper prefixes removed), so
that every rank writes its own shards and a checkpoint written under one plan loads under another
(DCP reshards each tensor from the saved shards to the loading rank's placement).

DCP describes a rank's shard as one block of the whole tensor, which a _StridedShard placement (a
fused qkv split q_r, k_r, v_r: runtime/torch_stack/tensor.py) is not: such tensors are written and read
replicated over the dimensions that stride them, and placed back after reading.
"""

from __future__ import annotations

import os

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim import Optimizer


def _states(model: nn.Module, optimizer: Optimizer | None) -> dict:
    if optimizer is None:
        msd, _ = get_state_dict(model, [])
        return {"model": msd}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def _unstrided(state):
    """`state` with every DTensor that has a _StridedShard placement replicated over that dimension."""
    if isinstance(state, dict):
        return {k: _unstrided(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_unstrided(v) for v in state]
    if isinstance(state, DTensor) and any(isinstance(p, _StridedShard) for p in state.placements):
        return state.redistribute(placements=[Replicate() if isinstance(p, _StridedShard) else p
                                              for p in state.placements])
    return state


def _restrided(loaded, like):
    """`loaded` (as _unstrided gave it, now read) placed back as `like` is."""
    if isinstance(like, dict):
        return {k: _restrided(loaded[k], v) for k, v in like.items()}
    if isinstance(like, list):
        return [_restrided(a, b) for a, b in zip(loaded, like)]
    if isinstance(like, DTensor) and loaded is not like:
        return loaded.redistribute(placements=like.placements)
    return loaded


def save(path: str | os.PathLike, model: nn.Module, optimizer: Optimizer | None = None,
         extra: dict | None = None) -> None:
    """Write the model's (and optimizer's) state under directory `path`, every rank its shards;
    `extra`: more state saved alongside (an LR scheduler's state_dict(), a step count)."""
    state = _states(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    dcp.save(_unstrided(state), checkpoint_id=os.fspath(path))


def load(path: str | os.PathLike, model: nn.Module, optimizer: Optimizer | None = None,
         extra: dict | None = None) -> dict | None:
    """Read a checkpoint written by `save` (under any plan) into the model (and optimizer), each tensor
    resharded to this rank's placement. `extra`: the same keys as saved, filled in and returned."""
    state = _states(model, optimizer)
    if extra is not None:
        state["extra"] = dict(extra)
    readable = _unstrided(state)
    dcp.load(readable, checkpoint_id=os.fspath(path))
    state = _restrided(readable, state)
    set_state_dict(model, [] if optimizer is None else optimizer, model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
    return state.get("extra")
