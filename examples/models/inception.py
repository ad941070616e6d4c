"""An Inception-style CNN: the zoo's model with parallel branches (sub-graph parallelism).

A stem conv, then ``num_modules`` Inception modules held in ``self.blocks`` (an
``nn.ModuleList``). Each module forks its input into four independent branches that are
joined by ``torch.cat`` on the channel dim:

    b1: 1x1 conv                                   -> c channels
    b2: 1x1 conv (c)         -> 3x3 conv           -> 2c channels
    b3: 1x1 conv (c/4)       -> 5x5 conv           -> c/2 channels
    b4: 3x3 maxpool (stride 1, pad 1) -> 1x1 conv  -> c/2 channels

(c = ``channels``; the branch widths follow GoogLeNet's uneven 64/128/32/32 split so the
branches have different costs, which is what makes placing them interesting.) Every conv
is followed by BatchNorm and ReLU. Module paths read ``blocks.<i>.b2.1.conv``.

Note: the modules are held in ``blocks``, not ``modules``: an attribute named
``modules`` would collide with ``nn.Module.modules()``.

Shapes: x (B, in_channels, H, W) float32, H = W = image_size pixels -> (B, num_classes).
Spatial size is kept by every module (all convs are "same"-padded with stride 1).
"""

from __future__ import annotations

import torch
from torch import nn


class ConvBNReLU(nn.Module):
    """k x k conv (stride 1, "same" padding, no bias) -> BatchNorm -> ReLU.

    (B, in_ch, H, W) -> (B, out_ch, H, W).
    """

    def __init__(self, in_ch: int, out_ch: int, k: int):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, k, padding=(k - 1) // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def branch_widths(channels: int) -> tuple[int, int, int, int]:
    """Output channels of (b1, b2, b3, b4) for an Inception module of width c."""
    half = max(channels // 2, 1)
    return channels, 2 * channels, half, half


class InceptionModule(nn.Module):
    """Four parallel branches on the same input, concatenated on channels.

    (B, in_ch, H, W) -> (B, sum(branch_widths(channels)), H, W).
    """

    def __init__(self, in_ch: int, channels: int):
        super().__init__()
        w1, w2, w3, w4 = branch_widths(channels)
        self.b1 = ConvBNReLU(in_ch, w1, 1)
        self.b2 = nn.Sequential(ConvBNReLU(in_ch, channels, 1), ConvBNReLU(channels, w2, 3))
        reduce5 = max(channels // 4, 1)
        self.b3 = nn.Sequential(ConvBNReLU(in_ch, reduce5, 1), ConvBNReLU(reduce5, w3, 5))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), ConvBNReLU(in_ch, w4, 1))
        self.out_channels = w1 + w2 + w3 + w4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, in_ch, H, W); the four branches share nothing but x (the fork).
        y1 = self.b1(x)                              # (B, c, H, W)
        y2 = self.b2(x)                              # (B, 2c, H, W)
        y3 = self.b3(x)                              # (B, c/2, H, W)
        y4 = self.b4(x)                              # (B, c/2, H, W)
        return torch.cat([y1, y2, y3, y4], dim=1)    # (B, out_channels, H, W)  (the join)


class InceptionNet(nn.Module):
    """Stem ConvBNReLU (3x3) -> Inception modules -> global avg pool -> Linear.

    Args:
        num_modules: number of Inception modules.
        channels: branch width c of every module (module output is 4c for even c).
        stem_channels: output channels of the stem conv.
        num_classes: classifier outputs.
        in_channels: channels of the input image.
    """

    def __init__(self, num_modules: int = 3, channels: int = 8, stem_channels: int = 16,
                 num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        _check_config(num_modules=num_modules, channels=channels,
                      stem_channels=stem_channels, num_classes=num_classes,
                      in_channels=in_channels)
        self.stem = ConvBNReLU(in_channels, stem_channels, 3)     # (B, stem, H, W)
        blocks = []
        in_ch = stem_channels
        for _ in range(num_modules):
            block = InceptionModule(in_ch, channels)
            blocks.append(block)
            in_ch = block.out_channels
        self.blocks = nn.ModuleList(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, in_channels, H, W)
        x = self.stem(x)                    # (B, stem_channels, H, W)
        for block in self.blocks:
            x = block(x)                    # (B, 4c, H, W)
        x = self.pool(x).flatten(1)         # (B, 4c)
        return self.fc(x)                   # (B, num_classes)


def _check_config(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"inception: {name} must be a positive integer, got {value!r}")


def build(num_modules: int = 3, channels: int = 8, stem_channels: int = 16,
          image_size: int = 32, num_classes: int = 10, in_channels: int = 3
          ) -> InceptionNet:
    """Factory used by model refs such as ``examples/models/inception.py:build``.

    ``image_size`` (pixels) does not change the network (global pooling); it is validated
    and accepted so build and example_inputs take the same keyword arguments.
    """
    _check_config(image_size=image_size)
    return InceptionNet(num_modules, channels, stem_channels, num_classes, in_channels)


def example_inputs(batch_size: int = 2, device: str | torch.device = "cpu",
                   num_modules: int = 3, channels: int = 8, stem_channels: int = 16,
                   image_size: int = 32, num_classes: int = 10, in_channels: int = 3
                   ) -> tuple[torch.Tensor, ...]:
    """Forward's positional inputs: ``(x,)``, x (B, in_channels, image_size, image_size).

    Deterministic (fixed seed); on the meta device only the shape is produced.
    """
    _check_config(image_size=image_size, in_channels=in_channels)
    shape = (batch_size, in_channels, image_size, image_size)
    if torch.device(device).type == "meta":
        return (torch.empty(shape, device="meta"),)
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g).to(device),)


def example_batch(batch_size: int, seed: int, num_modules: int = 3, channels: int = 8,
                  stem_channels: int = 16, image_size: int = 32, num_classes: int = 10,
                  in_channels: int = 3) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Synthetic classification batch on the CPU, a pure function of ``seed``.

    Returns ``((x,), targets)``: x (B, in_channels, image_size, image_size) from
    N(0, 1); targets (B,) int64 uniform random class indices in [0, num_classes).
    """
    _check_config(image_size=image_size, in_channels=in_channels, num_classes=num_classes)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_channels, image_size, image_size, generator=g)
    targets = torch.randint(0, num_classes, (batch_size,), generator=g)
    return (x,), targets
