"""A plain CNN for very large images: the zoo's target for spatial parallelism.

``features`` is an ``nn.Sequential`` of ConvBNReLU layers (paths ``features.<i>.conv``),
each a k x k conv with k odd (1, 3 or 5), stride 1 or 2 and padding (k - 1) // 2, so a
stride-1 layer keeps the spatial size and a stride-2 layer halves it (rounding up). Then a
MaxPool2d(2) (``pool``), global average pooling (``avgpool``) and a Linear (``fc``).

Because every conv pads by (k - 1) // 2, a tile of the image needs a halo of exactly that
many rows/columns from each neighbour; the network itself is size-agnostic, so it builds
(on meta) for 16384 x 16384 inputs as easily as for 256 x 256.

Shapes: x (B, in_channels, H, W) float32, H = W = image_size pixels -> (B, num_classes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# (out_channels, kernel_size, stride) per conv layer.
DEFAULT_LAYERS: tuple[tuple[int, int, int], ...] = (
    (8, 3, 1),
    (8, 3, 2),
    (16, 5, 1),
    (16, 3, 2),
    (16, 1, 1),
    (16, 3, 1),
)


class ConvBNReLU(nn.Module):
    """k x k conv (padding (k-1)//2, no bias) -> BatchNorm -> ReLU.

    (B, in_ch, H, W) -> (B, out_ch, ceil(H / stride), ceil(W / stride)).
    """

    def __init__(self, in_ch: int, out_ch: int, k: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, k, stride=stride, padding=(k - 1) // 2,
                              bias=False)
        self.bn = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def _check_layers(layers: Sequence[Sequence[int]]) -> tuple[tuple[int, int, int], ...]:
    try:
        spec = tuple((int(c), int(k), int(s)) for c, k, s in layers)
    except (TypeError, ValueError) as e:
        raise ValueError(f"large_image_cnn: layers must be a sequence of "
                         f"(out_channels, kernel_size, stride) triples, got {layers!r}") from e
    if not spec:
        raise ValueError("large_image_cnn: layers is empty; give at least one "
                         "(out_channels, kernel_size, stride) triple")
    for i, (c, k, s) in enumerate(spec):
        if c < 1:
            raise ValueError(f"large_image_cnn: layer {i} has out_channels={c}; "
                             f"must be positive")
        if k not in (1, 3, 5):
            raise ValueError(f"large_image_cnn: layer {i} has kernel_size={k}; use 1, 3 "
                             f"or 5 (odd, so padding (k-1)//2 keeps the size)")
        if s not in (1, 2):
            raise ValueError(f"large_image_cnn: layer {i} has stride={s}; use 1 or 2")
    return spec


def output_size(image_size: int, layers: Sequence[Sequence[int]] = DEFAULT_LAYERS) -> int:
    """Spatial size (pixels per side) after the conv layers and the 2x2 max pool.

    Raises ValueError when the image is too small to survive them.
    """
    spec = _check_layers(layers)
    if not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < 1:
        raise ValueError(f"large_image_cnn: image_size must be a positive integer "
                         f"(pixels), got {image_size!r}")
    n = image_size
    for _, _, s in spec:
        n = (n - 1) // s + 1          # conv with padding (k-1)//2: ceil(n / s)
    if n < 2:
        raise ValueError(f"large_image_cnn: image_size={image_size} shrinks to {n} pixel(s) "
                         f"after the convs, too small for MaxPool2d(2); use a larger image "
                         f"or fewer stride-2 layers")
    return n // 2


class LargeImageCNN(nn.Module):
    """ConvBNReLU x len(layers) -> MaxPool2d(2) -> AdaptiveAvgPool2d(1) -> Linear.

    Args:
        layers: (out_channels, kernel_size, stride) per conv; kernel in {1, 3, 5},
            stride in {1, 2}.
        num_classes: classifier outputs.
        in_channels: channels of the input image.
    """

    def __init__(self, layers: Sequence[Sequence[int]] = DEFAULT_LAYERS,
                 num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        spec = _check_layers(layers)
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"large_image_cnn: {name} must be a positive integer, "
                                 f"got {value!r}")
        convs = []
        in_ch = in_channels
        for c, k, s in spec:
            convs.append(ConvBNReLU(in_ch, c, k, s))
            in_ch = c
        self.features = nn.Sequential(*convs)
        self.pool = nn.MaxPool2d(2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, in_channels, H, W)
        x = self.features(x)                # (B, C, H', W'), H' = H / prod(strides)
        x = self.pool(x)                    # (B, C, H'/2, W'/2)
        x = self.avgpool(x).flatten(1)      # (B, C)
        return self.fc(x)                   # (B, num_classes)


def build(image_size: int = 256, layers: Sequence[Sequence[int]] = DEFAULT_LAYERS,
          num_classes: int = 10, in_channels: int = 3) -> LargeImageCNN:
    """Factory used by model refs such as ``examples/models/large_image_cnn.py:build``.

    ``image_size`` (pixels per side) does not change the weights; it is checked against
    ``layers`` (the image must survive the strides and the pool).
    """
    output_size(image_size, layers)
    return LargeImageCNN(layers, num_classes, in_channels)


def example_inputs(batch_size: int = 2, device: str | torch.device = "cpu",
                   image_size: int = 256, layers: Sequence[Sequence[int]] = DEFAULT_LAYERS,
                   num_classes: int = 10, in_channels: int = 3
                   ) -> tuple[torch.Tensor, ...]:
    """Forward's positional inputs: ``(x,)``, x (B, in_channels, image_size, image_size).

    Deterministic (fixed seed); on the meta device only the shape is produced, which is
    how 16384 x 16384 inputs are handled without allocating them.
    """
    output_size(image_size, layers)
    shape = (batch_size, in_channels, image_size, image_size)
    if torch.device(device).type == "meta":
        return (torch.empty(shape, device="meta"),)
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g).to(device),)


def example_batch(batch_size: int, seed: int, image_size: int = 256,
                  layers: Sequence[Sequence[int]] = DEFAULT_LAYERS, num_classes: int = 10,
                  in_channels: int = 3) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Synthetic classification batch on the CPU, a pure function of ``seed``.

    Returns ``((x,), targets)``: x (B, in_channels, image_size, image_size) from
    N(0, 1); targets (B,) int64 uniform random class indices in [0, num_classes).
    """
    output_size(image_size, layers)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_channels, image_size, image_size, generator=g)
    targets = torch.randint(0, num_classes, (batch_size,), generator=g)
    return (x,), targets
