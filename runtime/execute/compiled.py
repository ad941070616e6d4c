"""Compiled stages (Execution.compile): torch.compile of each stage's layer methods.

Regional compilation, as torchtitan compiles each transformer block: the generated stage class
has one method per layer, and the copies of a repeated block share one method that takes the
block's module as its `layer` argument (codegen/partition.py), so the one compiled function serves
every copy: the model compiles once per distinct layer, not once per layer. The layers that do not
repeat (embeddings, a final norm, the output layer) stay eager: each compiled region's call costs
its guards and its autograd wrapper (about 0.15 ms forward and backward on this repository's CPU
machine), more than fusing such a layer saves; a model with no repeated block (a repeated layer
holding parameters) compiles the layers that hold parameters instead. The stage's forward, its recomputation (torch.utils.checkpoint
around a compiled layer) and everything the executor does between layers (sends, receives,
gradient buckets, the loss) stay eager. Under compile scope "stage" (CompileScope.STAGE) the stage's whole
forward is the one compiled method, and with the compiled loss the last stage's forward and loss are
compiled together as one graph (runtime/execute/stage.py, runtime/losses.compiled_forward_loss).

Shapes are static (dynamic=False): every micro-batch of a run has the same shape, so after the
first step nothing recompiles in training (`compiled_graphs` counts the graphs made, which
rank_main records after every step). Evaluation (eval() mode, no gradient) compiles its own
variant once. A tensor-parallel layer's collectives (runtime/parallel/tensor/layers.py's autograd
functions) break the graph where they are; the pieces between them are compiled.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.execution import Execution
from runtime.spec import StageSpec


def compile_stage(stage: nn.Module, spec: StageSpec, execution: Execution) -> None:
    """Replace each of `stage`'s methods that spec.compiled names by its torch.compile'd version."""
    for name in spec.compiled:
        method = getattr(stage, name)
        # an instance attribute: `self.<name>(...)` in the generated code finds it before the class's method
        object.__setattr__(stage, name, torch.compile(method, dynamic=False, backend=execution.compile_backend))


def compiled_graphs() -> int:
    """How many graphs torch.compile has made in this process so far (dynamo's unique_graphs counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


__all__ = ["compile_stage", "compiled_graphs"]
