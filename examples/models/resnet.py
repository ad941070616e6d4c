"""Pre-activation ResNet (ResNet-v2, He et al. 2016, "Identity Mappings in Deep
Residual Networks").

Every residual unit is BN -> ReLU -> conv (pre-activation), and the identity path is
left untouched except where the shape changes, where a 1x1 projection conv (applied to
the pre-activated input, as in the paper's reference code) replaces it.

Depths:
    * 6n + 2 -> basic units (two 3x3 convs), e.g. 20, 56, 110;
    * 9n + 2 with depth >= 164 -> bottleneck units (1x1, 3x3, 1x1 with 4x expansion),
      e.g. 164, 1001.
    ("depth" counts the stem conv, the convs of the residual units and the final Linear;
    projection shortcuts are not counted.)

Layout (module paths): ``stem`` (conv, plus maxpool for the ImageNet stem), three stages
in ``stages`` (``stages.<i>.<j>`` is unit j of stage i; widths w, 2w, 4w, times 4 at the
unit outputs for bottlenecks; stride 2 at the first unit of stages 1 and 2), then
``bn``, ``relu``, ``pool``, ``fc``.

Shapes: x (B, in_channels, H, W) float32, H and W in pixels -> logits (B, num_classes).
The network is size-agnostic (adaptive pooling); ``image_size`` only sets the example
inputs.
"""

from __future__ import annotations

import torch
from torch import nn

STEMS = ("cifar", "imagenet")
BLOCKS = ("basic", "bottleneck")


def _conv(in_ch: int, out_ch: int, k: int, stride: int = 1) -> nn.Conv2d:
    # No bias: every conv feeds a BatchNorm (or the residual sum that feeds one).
    return nn.Conv2d(in_ch, out_ch, k, stride=stride, padding=(k - 1) // 2, bias=False)


class BasicBlock(nn.Module):
    """Pre-activation basic unit: (BN-ReLU-conv3x3) x 2, plus shortcut.

    (B, in_ch, H, W) -> (B, out_ch, H / stride, W / stride).
    """

    expansion = 1

    def __init__(self, in_ch: int, planes: int, stride: int = 1):
        super().__init__()
        out_ch = planes * self.expansion
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.relu1 = nn.ReLU()
        self.conv1 = _conv(in_ch, planes, 3, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv2 = _conv(planes, out_ch, 3)
        # Decided at build time, so forward has no data-dependent branch.
        self.shortcut = (_conv(in_ch, out_ch, 1, stride)
                         if stride != 1 or in_ch != out_ch else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, in_ch, H, W)
        a = self.relu1(self.bn1(x))                             # pre-activation
        identity = x if self.shortcut is None else self.shortcut(a)  # (B, out_ch, H', W')
        out = self.conv1(a)                                     # (B, planes, H', W')
        out = self.conv2(self.relu2(self.bn2(out)))             # (B, out_ch, H', W')
        return out + identity


class Bottleneck(nn.Module):
    """Pre-activation bottleneck unit: BN-ReLU-conv1x1, BN-ReLU-conv3x3 (stride),
    BN-ReLU-conv1x1 (4x expansion), plus shortcut.

    (B, in_ch, H, W) -> (B, 4 * planes, H / stride, W / stride).
    """

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int = 1):
        super().__init__()
        out_ch = planes * self.expansion
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.relu1 = nn.ReLU()
        self.conv1 = _conv(in_ch, planes, 1)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv2 = _conv(planes, planes, 3, stride)
        self.bn3 = nn.BatchNorm2d(planes)
        self.relu3 = nn.ReLU()
        self.conv3 = _conv(planes, out_ch, 1)
        self.shortcut = (_conv(in_ch, out_ch, 1, stride)
                         if stride != 1 or in_ch != out_ch else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, in_ch, H, W)
        a = self.relu1(self.bn1(x))
        identity = x if self.shortcut is None else self.shortcut(a)  # (B, 4p, H', W')
        out = self.conv1(a)                                     # (B, p, H, W)
        out = self.conv2(self.relu2(self.bn2(out)))             # (B, p, H', W')
        out = self.conv3(self.relu3(self.bn3(out)))             # (B, 4p, H', W')
        return out + identity


def block_layout(depth: int, block: str | None = None) -> tuple[str, int]:
    """(block kind, units per stage) for a depth; ValueError for invalid depths.

    Without ``block``, depths >= 164 of the form 9n + 2 use bottlenecks and otherwise
    6n + 2 uses basic units (so 110 is basic even though 110 = 9 * 12 + 2).
    """
    valid = ("use 6n+2 (basic units, e.g. 8, 20, 56, 110) or 9n+2 >= 164 (bottleneck "
             "units, e.g. 164, 1001)")
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 8:
        raise ValueError(f"resnet: invalid depth {depth!r}; {valid}")
    if block is not None and block not in BLOCKS:
        raise ValueError(f"resnet: unknown block {block!r}; choose one of {BLOCKS}")
    if block is None:
        if depth >= 164 and (depth - 2) % 9 == 0:
            block = "bottleneck"
        elif (depth - 2) % 6 == 0:
            block = "basic"
        else:
            raise ValueError(f"resnet: invalid depth {depth}; {valid}")
    per_unit = 2 if block == "basic" else 3
    if (depth - 2) % (3 * per_unit) != 0:
        raise ValueError(
            f"resnet: depth {depth} does not fit {block} units: need depth = "
            f"{3 * per_unit}n + 2 (3 stages of n units with {per_unit} convs each, plus "
            f"stem conv and classifier), e.g. "
            f"{'20, 56, 110' if block == 'basic' else '164, 1001'}")
    return block, (depth - 2) // (3 * per_unit)


class PreActResNet(nn.Module):
    """Pre-activation ResNet for image classification (see module docstring).

    Args:
        depth: network depth (6n + 2 basic, 9n + 2 >= 164 bottleneck).
        num_classes: classifier outputs.
        width: channels of the first stage (w); stages use w, 2w, 4w.
        in_channels: channels of the input image.
        stem: "cifar" (3x3 conv, stride 1) or "imagenet" (7x7 conv stride 2 + 3x3
            maxpool stride 2, for large images).
        block: force "basic" or "bottleneck"; None picks from depth.
    """

    def __init__(self, depth: int = 20, num_classes: int = 10, width: int = 16,
                 in_channels: int = 3, stem: str = "cifar", block: str | None = None):
        super().__init__()
        kind, n = block_layout(depth, block)
        for name, value in (("num_classes", num_classes), ("width", width),
                            ("in_channels", in_channels)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"resnet: {name} must be a positive integer, got {value!r}")
        if stem not in STEMS:
            raise ValueError(f"resnet: unknown stem {stem!r}; choose one of {STEMS}")
        unit = BasicBlock if kind == "basic" else Bottleneck
        self.depth, self.block, self.units_per_stage = depth, kind, n

        if stem == "cifar":
            self.stem = nn.Sequential(_conv(in_channels, width, 3))          # (B, w, H, W)
        else:
            self.stem = nn.Sequential(                                       # (B, w, H/4, W/4)
                _conv(in_channels, width, 7, stride=2),
                nn.MaxPool2d(3, stride=2, padding=1))

        stages = []
        in_ch = width
        for i, planes in enumerate((width, 2 * width, 4 * width)):
            units = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                units.append(unit(in_ch, planes, stride))
                in_ch = planes * unit.expansion
            stages.append(nn.Sequential(*units))
        self.stages = nn.ModuleList(stages)
        self.bn = nn.BatchNorm2d(in_ch)   # final pre-activation
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, in_channels, H, W)
        x = self.stem(x)                          # (B, w, H0, W0)
        for stage in self.stages:
            x = stage(x)                          # (B, C_i, H_i, W_i)
        x = self.relu(self.bn(x))                 # (B, C, H/4, W/4) for the CIFAR stem
        x = self.pool(x).flatten(1)               # (B, C)
        return self.fc(x)                         # (B, num_classes)


def num_convs(depth: int, block: str | None = None) -> int:
    """Number of Conv2d layers, projection shortcuts included (3 for bottlenecks, whose
    first stage already changes channels; 2 for basic units)."""
    kind, _ = block_layout(depth, block)
    return depth - 1 + (2 if kind == "basic" else 3)


def _check_image(image_size: int) -> None:
    if not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < 1:
        raise ValueError(f"resnet: image_size must be a positive integer (pixels), "
                         f"got {image_size!r}")


def build(depth: int = 20, num_classes: int = 10, width: int = 16, image_size: int = 32,
          in_channels: int = 3, stem: str = "cifar", block: str | None = None
          ) -> PreActResNet:
    """Factory used by model refs such as ``examples/models/resnet.py:build``.

    ``image_size`` (pixels) does not change the network; it is validated and accepted so
    build and example_inputs take the same keyword arguments.
    """
    _check_image(image_size)
    return PreActResNet(depth, num_classes, width, in_channels, stem, block)


def example_inputs(batch_size: int = 2, device: str | torch.device = "cpu",
                   depth: int = 20, num_classes: int = 10, width: int = 16,
                   image_size: int = 32, in_channels: int = 3, stem: str = "cifar",
                   block: str | None = None) -> tuple[torch.Tensor, ...]:
    """Forward's positional inputs: ``(x,)``, x (B, in_channels, image_size, image_size).

    Deterministic (fixed seed); on the meta device only the shape is produced.
    """
    _check_image(image_size)
    shape = (batch_size, in_channels, image_size, image_size)
    if torch.device(device).type == "meta":
        return (torch.empty(shape, device="meta"),)
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g).to(device),)


def example_batch(batch_size: int, seed: int, depth: int = 20, num_classes: int = 10,
                  width: int = 16, image_size: int = 32, in_channels: int = 3,
                  stem: str = "cifar", block: str | None = None
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Synthetic classification batch on the CPU, a pure function of ``seed``.

    Returns ``((x,), targets)``: x (B, in_channels, image_size, image_size) from
    N(0, 1); targets (B,) int64 uniform random class indices in [0, num_classes).
    """
    _check_image(image_size)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_channels, image_size, image_size, generator=g)
    targets = torch.randint(0, num_classes, (batch_size,), generator=g)
    return (x,), targets
