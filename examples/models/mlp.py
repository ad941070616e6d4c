"""A plain multi-layer perceptron: the smallest model in the zoo.

The layers live in one ``nn.Sequential`` called ``net`` so their module paths are
``net.0`` (Linear), ``net.1`` (ReLU), ``net.2`` (Linear), ... which makes it the easiest
model to cut into pipeline stages or shard with tensor parallelism in unit tests.

Shapes: input (B, in_features) float32 -> logits (B, out_features).
"""

from __future__ import annotations

import torch
from torch import nn

# Seed of the fixed "teacher" that labels the synthetic data (independent of the batch
# seed, so every batch is labelled by the same function and the task is learnable).
_TEACHER_SEED = 1234


class MLP(nn.Module):
    """Linear -> ReLU -> ... -> Linear.

    Args:
        in_features: features per sample at the input.
        hidden: width of every hidden layer (features).
        num_layers: number of Linear layers (>= 1); ReLU sits between consecutive ones.
        out_features: features (classes) per sample at the output.
    """

    def __init__(self, in_features: int, hidden: int, num_layers: int, out_features: int):
        super().__init__()
        _check_config(in_features, hidden, num_layers, out_features)
        widths = [in_features] + [hidden] * (num_layers - 1) + [out_features]
        layers: list[nn.Module] = []
        for i in range(num_layers):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if i < num_layers - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, in_features) -> (B, out_features)
        return self.net(x)


def _check_config(in_features: int, hidden: int, num_layers: int, out_features: int) -> None:
    for name, value in (("in_features", in_features), ("hidden", hidden),
                        ("num_layers", num_layers), ("out_features", out_features)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mlp: {name} must be a positive integer, got {value!r}")


def build(in_features: int = 16, hidden: int = 32, num_layers: int = 3,
          out_features: int = 10) -> MLP:
    """Factory used by model refs such as ``examples/models/mlp.py:build``."""
    return MLP(in_features, hidden, num_layers, out_features)


def example_inputs(batch_size: int = 2, device: str | torch.device = "cpu",
                   in_features: int = 16, hidden: int = 32, num_layers: int = 3,
                   out_features: int = 10) -> tuple[torch.Tensor, ...]:
    """Forward's positional inputs: ``(x,)`` with x of shape (batch_size, in_features).

    Deterministic (fixed seed); on the meta device only the shape is produced.
    """
    _check_config(in_features, hidden, num_layers, out_features)
    if torch.device(device).type == "meta":
        return (torch.empty(batch_size, in_features, device="meta"),)
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, in_features, generator=g).to(device),)


def example_batch(batch_size: int, seed: int, in_features: int = 16, hidden: int = 32,
                  num_layers: int = 3, out_features: int = 10
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Synthetic training batch on the CPU, a pure function of ``seed``.

    Returns ``((x,), targets)``: x (B, in_features) float32 drawn from N(0, 1); targets
    (B,) int64 class indices in [0, out_features), the argmax of a fixed random linear
    teacher applied to x (so a model can actually learn them).
    """
    _check_config(in_features, hidden, num_layers, out_features)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_features, generator=g)  # (B, in_features)
    teacher = torch.randn(in_features, out_features,
                          generator=torch.Generator().manual_seed(_TEACHER_SEED))
    targets = (x @ teacher).argmax(dim=1)  # (B,)
    return (x,), targets
