"""Distributed Checkpoint (torch.distributed.checkpoint) for a parallelized model and its optimizer.

The state dicts come from torch.distributed.checkpoint.state_dict (get_state_dict / set_state_dict):
parameters and optimizer state as DTensors under their canonical names (wrapper prefixes removed), so
that every rank writes its own shards and a checkpoint written under one plan loads under another
(DCP reshards each tensor from the saved shards to the loading rank's placement).
"""

from __future__ import annotations

import os

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer


def _states(model: nn.Module, optimizer: Optimizer | None) -> dict:
    if optimizer is None:
        msd, _ = get_state_dict(model, [])
        return {"model": msd}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def save(path: str | os.PathLike, model: nn.Module, optimizer: Optimizer | None = None,
         extra: dict | None = None) -> None:
    """Write the model's (and optimizer's) state under directory `path`, every rank its shards;
    `extra`: more state saved alongside (an LR scheduler's state_dict(), a step count)."""
    state = _states(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    dcp.save(state, checkpoint_id=os.fspath(path))


def load(path: str | os.PathLike, model: nn.Module, optimizer: Optimizer | None = None,
         extra: dict | None = None) -> dict | None:
    """Read a checkpoint written by `save` (under any plan) into the model (and optimizer), each tensor
    resharded to this rank's placement. `extra`: the same keys as saved, filled in and returned."""
    state = _states(model, optimizer)
    if extra is not None:
        state["extra"] = dict(extra)
    dcp.load(state, checkpoint_id=os.fspath(path))
    set_state_dict(model, [] if optimizer is None else optimizer, model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
    return state.get("extra")
