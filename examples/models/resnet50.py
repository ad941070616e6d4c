"""ResNet-50 as torchvision builds it (v1.5: the stride on the 3x3 conv), written out here.

torchvision's wheels on PyPI are CUDA builds; next to the CPU build of torch this project
pins, `import torchvision` fails ("operator torchvision::nms does not exist"), so the tests
use this copy: the same module layout (`conv1`, `bn1`, `relu`, `maxpool`, `layer1` ..
`layer4` of Bottleneck blocks [3, 4, 6, 3], `avgpool`, `fc`), the same blocks (1x1, 3x3
with the stride, 1x1 with 4x expansion, each followed by BatchNorm; a 1x1 conv + BatchNorm
downsample where the shape changes) and torchvision's initialisation (Kaiming-normal convs,
BatchNorm weight 1, bias 0). A model built with the defaults has the parameter names and
shapes of torchvision.models.resnet50().

`width` scales every channel count (64 is ResNet-50's); `layers` sets the blocks per stage.
Shapes: x (B, 3, H, W) float32 -> logits (B, num_classes).
"""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    """1x1 (planes) -> 3x3 (planes, stride) -> 1x1 (4 x planes), BatchNorm after each, ReLU,
    plus the identity or a downsample. (B, in_ch, H, W) -> (B, 4 planes, H / stride, W / stride)."""

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int = 1):
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = nn.Conv2d(in_ch, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(out_ch))
                           if stride != 1 or in_ch != out_ch else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = width
        for i, blocks in enumerate(layers):
            planes = width * 2 ** i
            stage = []
            for j in range(blocks):
                stage.append(Bottleneck(in_ch, planes, stride=2 if i > 0 and j == 0 else 1))
                in_ch = planes * Bottleneck.expansion
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))     # (B, w, H/4, W/4)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # (B, 32 w, H/32, W/32)
        return self.fc(torch.flatten(self.avgpool(x), 1))          # (B, num_classes)


def build(width: int = 64, num_classes: int = 1000, layers: tuple[int, ...] = (3, 4, 6, 3),
          image_size: int = 224) -> ResNet:
    """ResNet-50 (defaults) or a narrower / shallower one; `image_size` only sets the example batch."""
    return ResNet(tuple(layers), num_classes, width)


def example_inputs(batch_size: int = 2, device: str | torch.device = "cpu", image_size: int = 224,
                   **_: object) -> tuple[torch.Tensor]:
    return (torch.zeros(batch_size, 3, image_size, image_size, device=device),)


def example_batch(batch_size: int, seed: int, image_size: int = 224, num_classes: int = 1000,
                  **_: object) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Images whose class shifts the mean of one colour channel (targets (B,) class ids)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (batch_size,), generator=g)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    x[torch.arange(batch_size), labels % 3] += (labels.float() / num_classes)[:, None, None]
    return (x,), labels
