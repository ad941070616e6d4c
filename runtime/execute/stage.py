"""`StageRunner`: forward and backward of one pipeline stage, per micro-batch.

Forward keeps what backward needs (the stage's inputs that take gradients,
its outputs, or the loss on the last stage) keyed by micro-batch; backward
releases it. On the last stage the loss is scaled by 1/(micro-batches x
data degree) before backward, so that gradients summed over micro-batches
and over data ranks are those of the mean loss over the global batch.

The loss stays on the device (a 0-dim tensor): the executor adds it up and reads
it once per step, so a micro-batch costs no host sync. The stage module and the
loss run in one autocast region, whose cache casts each weight once per forward.
A stage whose spec has a fused output head (runtime/execute/output_head.py) returns the
hidden state, and the loss is computed from it and the head's weight in chunks.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from runtime.execute.evaluation import count_correct
from runtime import losses
from runtime.losses import compute_loss, model_output
from runtime.execute.output_head import fused_eval, fused_loss
from runtime.spec import StageSpec
from runtime.vocab import DType


class StageRunner:
    """Runs `module` (the generated stage module) for micro-batches.

    Args:
        spec: the stage's StageSpec.
        module: the stage module (forward(*inputs) -> tuple of outputs, or the model
            output on the last stage).
        loss: loss name (last stage only); class_split: (first class, tensor group) for
            vocabulary-parallel logits.
        loss_scale: factor applied to each micro-batch loss before backward.
        dtype: "fp32" or "bf16"/"fp16" (autocast; parameters stay fp32).
        chunk_tokens: tokens per chunk of a fused loss (0: runtime.execute.chunked_loss's rule).
        compiled_loss: torch.compile's backend for the loss (Execution.loss "compiled",
            runtime.losses.compiled_loss), or None: the eager loss. Only where the logits are whole
            (no class_split); held-out evaluation stays eager. On a last stage whose whole forward is
            compiled (spec.compiled names "forward") the forward and the loss compile as one graph
            (runtime.losses.compiled_forward_loss).
    """

    def __init__(self, spec: StageSpec, module: nn.Module, *, loss: str = "cross_entropy",
                 class_split=None, loss_scale: float = 1.0, dtype: str = DType.FP32,
                 device: torch.device | str = "cpu", chunk_tokens: int = 0, compiled_loss: str | None = None):
        self.spec = spec
        self.module = module
        self.loss_name = loss
        self.class_split = class_split
        self.loss_scale = float(loss_scale)
        self.device = torch.device(device)
        self.dtype = dtype
        self.chunk_tokens = int(chunk_tokens)
        self._saved: dict[int, tuple] = {}
        self._fused = spec.head if spec.is_last and spec.head is not None and spec.head.fused else None
        if compiled_loss is not None and class_split is not None:
            raise ValueError("a compiled loss needs the whole logits on the rank; this stage's are split by class "
                             "(the vocabulary-parallel loss runs eager)")
        self._compiled = losses.compiled_loss(loss, compiled_loss) if compiled_loss is not None and spec.is_last \
            and self._fused is None else None
        # a stage compiled whole (compile scope "stage"): its forward and the loss compile as one graph
        self._joint = losses.compiled_forward_loss(module, loss, compiled_loss) \
            if self._compiled is not None and "forward" in spec.compiled else None

    def _autocast(self):
        if self.dtype == DType.FP32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, DType(self.dtype).torch_name))

    def forward(self, micro: int, inputs: list[torch.Tensor], targets: torch.Tensor | None = None):
        """Run forward; returns the tensors to send (non-last stage) or the loss (last stage: a 0-dim
        tensor on the device, with its graph)."""
        args = []
        for b, x in zip(self.spec.inputs, inputs):
            if b.requires_grad and x.is_floating_point():
                x = x.detach().requires_grad_(True)
            args.append(x)
        with self._autocast():
            if self._joint is not None:
                loss = self._joint(targets, *args)
            else:
                out = self.module(*args)
                if self.spec.is_last:
                    loss = self._loss(out, targets)
        if self.spec.is_last:
            self._saved[micro] = (args, loss)
            return loss
        outs = self._outputs(out)
        self._saved[micro] = (args, outs)
        return outs

    def _loss(self, out, targets: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return fused_loss(self._fused, self.module, out, targets, class_split=self.class_split,
                              chunk_tokens=self.chunk_tokens)
        if self._compiled is not None:
            logits = model_output(out)
            wide = losses.padded_base(logits)   # a padded vocabulary: narrowed inside the compiled loss
            return self._compiled(logits, targets) if wide is None else self._compiled(wide, targets, logits.shape[-1])
        return compute_loss(self.loss_name, out, targets, class_split=self.class_split)

    def evaluate(self, inputs: list[torch.Tensor], targets: torch.Tensor | None = None):
        """Forward only, keeping no graph (held-out evaluation; the caller sets eval() mode): the tensors
        to send (non-last stage), or on the last stage (mean loss as a 0-dim tensor, correct predictions,
        target elements counted) of the micro-batch (runtime.execute.evaluation.count_correct; with a fused
        head runtime.execute.chunked_loss.chunked_eval, which counts the targets not ignored)."""
        with torch.no_grad():
            with self._autocast():
                out = self.module(*inputs)
                if not self.spec.is_last:
                    return self._outputs(out)
                if self._fused is not None:
                    return fused_eval(self._fused, self.module, out, targets, class_split=self.class_split,
                                      chunk_tokens=self.chunk_tokens)
                loss = compute_loss(self.loss_name, out, targets, class_split=self.class_split)
            correct, counted = count_correct(self.loss_name, out, targets, self.class_split)
        return loss, correct, counted

    def _outputs(self, out) -> list[torch.Tensor]:
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != len(self.spec.outputs):
            raise RuntimeError(f"stage {self.spec.index} returned {len(outs)} tensors, its spec sends "
                               f"{len(self.spec.outputs)}")
        return outs

    def backward(self, micro: int, grads: list[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
        """Backward of one micro-batch; returns the gradients of the inputs that take them
        (None for the others), in input order."""
        args, out = self._saved.pop(micro)
        if self.spec.is_last:
            (out * self.loss_scale).backward()
        else:
            pairs = [(o, g) for o, b, g in zip(out, self.spec.outputs, grads or [None] * len(out))
                     if b.requires_grad and g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
        return [a.grad if (b.requires_grad and isinstance(a, torch.Tensor) and a.requires_grad) else None
                for a, b in zip(args, self.spec.inputs)]

    def pending(self) -> int:
        return len(self._saved)
