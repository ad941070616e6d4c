"""planner.parallelize: a plan applied to the user's own model with PyTorch's parallel stack, for the
user's own training loop.

    dist.init_process_group("gloo")            # or nccl; torchrun starts the plan's processes
    pm = planner.parallelize(model, plan, graph=graph)
    for inputs, targets in batches:
        loss = loss_fn(pm(*pm.local_batch(inputs)), pm.local_batch(targets))
        loss.backward()
        pm.clip_grad_norm_(1.0)
        optimizer.step(); optimizer.zero_grad(); scheduler.step()

A pipeline plan's model is this rank's stages (codegen/torch_target/pipeline.py: meshplan's own
partition, holding the model's own tensors) run by torch's schedule; the loop steps the pipeline:

    pm = planner.parallelize(model, plan, graph=graph, loss_fn=loss_fn)   # loss_fn(output, target)
    for inputs, targets in batches:                                       # inputs: dict by name
        losses = []
        pm.pipeline.step(target=pm.local_batch(targets), losses=losses, **pm.local_batch(inputs))
        optimizer.step(); optimizer.zero_grad()

The layout comes from codegen/torch_target/layout.py (the same derivation the torch script writes
out) and is applied by runtime/torch_stack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from codegen.torch_target.layout import TorchLayout, torch_layout
from codegen.torch_target.pipeline import rank_pipeline
from planner.binding import graph_mismatch
from planner.graph.capture import capture
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.torch_stack import dcp
from runtime.torch_stack.apply import apply_layout
from runtime.torch_stack.data import apply_data
from runtime.torch_stack.grad_norm import clip_grad_norm_
from runtime.torch_stack.mesh import build_mesh, check_mesh, check_world, mesh_dims
from runtime.torch_stack.pipeline import PipelineRun
from runtime.vocab import Backend


class ParallelizeError(ValueError):
    """The model, graph or process group does not fit the plan; the message names both sides."""


@dataclass
class ParallelModel:
    """The user's model parallelized as a plan says, with what a plain training loop needs.

    module: the model, changed in place (DTensor parameters, fully_shard/replicate, checkpoint wrappers).
    mesh: the DeviceMesh (dimensions named by axis: "data", "tensor").
    layout: the TorchLayout applied.
    """

    module: nn.Module
    mesh: DeviceMesh
    layout: TorchLayout
    pipeline: PipelineRun | None = None   # a pipeline plan: this rank's stages and torch's schedule

    def __call__(self, *args, **kwargs) -> Any:
        if self.pipeline is not None:
            raise ParallelizeError("a pipeline plan's model runs micro-batches through its schedule: call "
                                   "pm.pipeline.step(target=..., losses=[], **inputs) instead of pm(...)")
        return self.module(*args, **kwargs)

    forward = __call__

    def parameters(self):
        """This rank's parameters (of its pipeline stages, under a pipeline plan)."""
        return iter(self.pipeline.parameters()) if self.pipeline is not None else self.module.parameters()

    def named_parameters(self):
        return iter(self.pipeline.named_parameters()) if self.pipeline is not None else \
            self.module.named_parameters()

    @property
    def num_data(self) -> int:
        """Data-parallel ranks (1 without a data axis)."""
        names = self.mesh.mesh_dim_names or ()
        return self.mesh["data"].size() if "data" in names else 1

    @property
    def data_rank(self) -> int:
        """This rank's index along the data axis."""
        names = self.mesh.mesh_dim_names or ()
        return self.mesh["data"].get_local_rank() if "data" in names else 0

    def local_batch(self, batch: Any) -> Any:
        """This data rank's samples of a global batch (tensors, or a tuple/list/dict of them) whose dim 0
        holds the samples; the global batch must divide evenly over the data ranks."""
        if isinstance(batch, dict):
            return {k: self.local_batch(v) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.local_batch(v) for v in batch)
        if batch.shape[0] % self.num_data:
            raise ParallelizeError(f"a batch of {batch.shape[0]} samples does not split over {self.num_data} data "
                                   f"ranks; use a multiple of {self.num_data}")
        n = batch.shape[0] // self.num_data
        return batch[self.data_rank * n:(self.data_rank + 1) * n]

    def mean_over_data(self, value: torch.Tensor) -> float:
        """The mean of a per-rank scalar (a loss) over the data ranks, for logging the global batch's loss."""
        if self.num_data == 1:
            return float(value.detach())
        t = value.detach().float().reshape(1).clone()
        dist.all_reduce(t, group=self.mesh["data"].get_group())
        return float(t) / self.num_data

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients to total norm `max_norm` across every mesh; returns the norm before clipping
        (the single-process model's norm)."""
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm_(max_norm, norm_type)
        return clip_grad_norm_(self.module.parameters(), max_norm, norm_type)

    def _stateful(self) -> nn.Module:
        """The module whose state this rank saves and loads: the model, or under a pipeline plan its
        stages' tensors under the model's names (the rest of the model is other ranks')."""
        return self.pipeline.state_module(self.module) if self.pipeline is not None else self.module

    def state_dict(self) -> dict:
        """The model's state as DTensors under canonical names (torch.distributed.checkpoint.state_dict)."""
        return get_model_state_dict(self._stateful())

    def load_state_dict(self, state: dict) -> None:
        """Load a state from state_dict() of this or any other plan of the same model (DTensors or full
        tensors; each is resharded to this rank's placement)."""
        set_model_state_dict(self._stateful(), state)

    def save(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
             extra: dict | None = None) -> None:
        """Distributed Checkpoint of the model (and optimizer, and `extra` state) under directory `path`."""
        dcp.save(path, self._stateful(), optimizer, extra)

    def load(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
             extra: dict | None = None) -> dict | None:
        """Load a checkpoint written by save() under any plan; returns `extra` filled in."""
        return dcp.load(path, self._stateful(), optimizer, extra)


def parallelize(model: nn.Module, plan: Plan, *, mesh: DeviceMesh | None = None, graph: ModelGraph | None = None,
                example_inputs: Any = None, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
                ) -> ParallelModel:
    """Apply `plan` to `model` (in place) inside an initialized process group of the plan's size.

    The layout needs the model's captured graph: pass `graph` (the ModelGraph the plan was made from)
    or `example_inputs` (forward's inputs for a small batch; the model is captured now). `mesh`: a
    DeviceMesh with the plan's dimensions (built from the plan when None). loss_fn(output, target):
    for pipeline plans, the mean loss of one micro-batch, run on the last stage by the schedule.
    """
    if graph is None:
        if example_inputs is None:
            raise ParallelizeError("parallelize needs the model's captured graph: pass graph= (the ModelGraph the "
                                   "plan was made from) or example_inputs= (forward's inputs for a small batch)")
        graph = capture(model, example_inputs)
    mismatch = graph_mismatch(plan, graph)
    if mismatch:
        raise ParallelizeError(f"{mismatch}; make the plan for this model, or pass the graph the plan was made from")
    layout = torch_layout(plan, graph)
    if layout.pipeline is not None and loss_fn is None:
        raise ParallelizeError(f"the plan has {layout.pipeline.num_stages} pipeline stages, whose schedule "
                               "computes the loss on the last stage: pass loss_fn=(output, target) -> the mean "
                               "loss of one micro-batch")
    layout_dict = layout.to_dict()
    check_world(mesh_dims(layout_dict))
    if mesh is None:
        mesh = build_mesh(layout_dict, "cuda" if dist.get_backend() == Backend.NCCL else "cpu")
    else:
        check_mesh(mesh, layout_dict)
    if layout.pipeline is not None:
        data_mesh = mesh["data"] if "data" in (mesh.mesh_dim_names or ()) else None
        run = rank_pipeline(layout.pipeline, model, mesh, loss_fn, device=_device(mesh),
                            wrap=lambda m: apply_data(m, layout_dict, data_mesh))
        return ParallelModel(model, mesh, layout, run)
    apply_layout(model, layout_dict, mesh)
    return ParallelModel(model, mesh, layout)


def _device(mesh: DeviceMesh) -> torch.device:
    """This rank's device on `mesh` (its current CUDA device under NCCL)."""
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
