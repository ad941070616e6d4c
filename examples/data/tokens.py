"""A memory-mapped token file as a torch Dataset, for language models.

File format: a flat array of token ids, uint16 or uint32 in the machine's byte order, in
`NAME.bin`, and a sidecar `NAME.bin.json` that records {"dtype": "uint16"|"uint32",
"num_tokens": n, "vocab_size": v}, so the width is read, never guessed.

Sample i is the window tokens[i*seq_len : i*seq_len + seq_len + 1] (stride seq_len: windows share
one token, the next window's first input is this window's last target), split into
input_ids = window[:-1] and targets = window[1:], both (seq_len,) int64. A file of n tokens gives
(n - 1) // seq_len samples. The file is opened with numpy.memmap: a sample reads only its window.

    meshplan codegen examples/models/gpt.py:build --arg preset=tiny --arg vocab_size=256 \\
        --dataset examples/data/tokens.py:TokenFile --dataset-arg path=corpus.bin --dataset-arg seq_len=16 ...
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

DTYPES = ("uint16", "uint32")


class TokenFileError(ValueError):
    """A token file that is missing, or whose sidecar does not describe it."""


def sidecar(path: str | Path) -> Path:
    """The .json file next to token file `path` that records its dtype."""
    return Path(str(path) + ".json")


def write_tokens(path: str | Path, tokens: np.ndarray | list[int], dtype: str = "uint16",
                 vocab_size: int | None = None) -> Path:
    """Write token ids to `path` and its sidecar; TokenFileError when an id does not fit `dtype`."""
    if dtype not in DTYPES:
        raise TokenFileError(f"token dtype {dtype!r} is not one of {DTYPES}")
    arr = np.asarray(tokens, dtype=np.int64)
    top = np.iinfo(dtype).max
    if arr.size and (arr.min() < 0 or arr.max() > top):
        raise TokenFileError(f"token ids span [{arr.min()}, {arr.max()}], outside {dtype} [0, {top}]; use uint32")
    path = Path(path)
    arr.astype(dtype).tofile(path)
    meta = {"dtype": dtype, "num_tokens": int(arr.size),
            "vocab_size": int(vocab_size if vocab_size is not None else (arr.max() + 1 if arr.size else 0))}
    sidecar(path).write_text(json.dumps(meta))
    return path


def read_meta(path: str | Path) -> dict:
    """The sidecar of token file `path`, checked against the file's size."""
    path, meta_path = Path(path), sidecar(path)
    if not path.is_file():
        raise TokenFileError(f"token file {path} does not exist; write one with "
                             "`python -m examples.data.tokenize_text IN.txt -o OUT.bin`")
    if not meta_path.is_file():
        raise TokenFileError(f"token file {path} has no sidecar {meta_path} recording its dtype; write the file with "
                             "examples.data.tokens.write_tokens")
    meta = json.loads(meta_path.read_text())
    if meta.get("dtype") not in DTYPES:
        raise TokenFileError(f"{meta_path}: dtype {meta.get('dtype')!r} is not one of {DTYPES}")
    size = path.stat().st_size
    if size != meta.get("num_tokens", -1) * np.dtype(meta["dtype"]).itemsize:
        raise TokenFileError(f"token file {path} has {size} bytes, but {meta_path} says {meta.get('num_tokens')} "
                             f"{meta['dtype']} tokens; write both again")
    return meta


class TokenFile(Dataset):
    """Non-overlapping next-token windows of a token file (module docstring).

    Args:
        path: the .bin file (relative paths: from the working directory).
        seq_len: tokens per sample (T).
    """

    def __init__(self, path: str, seq_len: int) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise TokenFileError(f"seq_len must be a positive integer, got {seq_len!r}")
        self.meta = read_meta(path)
        self.path, self.seq_len = str(path), seq_len
        self.tokens = np.memmap(path, dtype=self.meta["dtype"], mode="r") if self.meta["num_tokens"] else \
            np.zeros(0, dtype=self.meta["dtype"])
        if len(self) < 1:
            raise TokenFileError(f"token file {path} has {self.meta['num_tokens']} tokens, fewer than one window of "
                                 f"seq_len + 1 = {seq_len + 1}")

    def __len__(self) -> int:
        return max(0, (self.meta["num_tokens"] - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of a token file with {len(self)} samples")
        start = i * self.seq_len
        window = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))  # (T+1,)
        return window[:-1], window[1:]
