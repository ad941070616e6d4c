"""Tiny datasets for tests/unit/test_datasets.py, named by reference ("tests/dataset_cases.py:NAME").

Sample i of IndexDataset is (tensor([i]), tensor(i)): a batch's targets are the dataset indices it read.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset


class IndexDataset(Dataset):
    """n samples; sample i = (tensor([i]) float, tensor(i)); `offset` shifts the values (an eval split)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset
        self.read: list[int] = []   # indices fetched, in order (workers 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.read.append(i)
        return torch.tensor([float(i + self.offset)]), torch.tensor(i + self.offset)


class IndexStream(IterableDataset):
    """An n-sample stream: epoch e yields (tensor([100 e + k]), tensor(100 e + k)) for k < n."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.epochs_set = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __iter__(self):
        for k in range(self.n):
            v = 100 * self.epoch + k
            yield torch.tensor([float(v)]), torch.tensor(v)


class DictDataset(Dataset):
    """Keyword inputs: sample i = ({"input_ids": tensor([i, i])}, tensor(i))."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return {"input_ids": torch.tensor([i, i])}, torch.tensor(i)


class TensorOnly(Dataset):
    """A bad dataset: a sample is a bare tensor, not (inputs, target)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.tensor([float(i)])


def index_dataset(n: int = 40, split: str = "train") -> IndexDataset:
    """A factory (not a class): the "val" split's values start at 1000."""
    return IndexDataset(n, 1000 if split == "val" else 0)


def pair_collate(samples: list, scale: float = 1.0):
    """A collate function with a keyword: inputs scaled, returned as a bare tensor."""
    return torch.stack([s[0] for s in samples]) * scale, torch.stack([s[1] for s in samples])
