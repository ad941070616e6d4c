"""Source of a small model whose side tensor (a gate from the input) reaches every block.

Tests write it to a temporary file and refer to it as "<file>:build", as a user would.
"""

SOURCE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.lin = nn.Linear(c, c)

    def forward(self, h, gate):
        return h + torch.tanh(self.lin(h)) * gate


class SideNet(nn.Module):
    def __init__(self, c=16, depth=3):
        super().__init__()
        self.inp = nn.Linear(8, c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(depth))
        self.out = nn.Linear(c, 4)

    def forward(self, x):
        gate = torch.sigmoid(x.sum(-1, keepdim=True))   # (B, 1), read by every block
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, gate)
        return self.out(h)


def build():
    return SideNet()


def example_inputs(batch_size=2, device="cpu"):
    return (torch.zeros(batch_size, 8, device=device),)


def example_batch(batch_size, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 8, generator=g)
    return (x,), torch.randint(0, 4, (batch_size,), generator=g)
'''


def write(directory) -> str:
    """Write the model file; returns its factory reference."""
    path = directory / "sidenet.py"
    path.write_text(SOURCE)
    return f"{path}:build"
