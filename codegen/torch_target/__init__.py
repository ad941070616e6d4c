"""PyTorch's own parallel stack as a target of meshplan plans."""
