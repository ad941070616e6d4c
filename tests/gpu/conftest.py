"""The gpu tier: the CUDA and NCCL paths at world size 1, run on a machine with a GPU.

Every test here needs CUDA; without it each is skipped with the reason "no CUDA device", so a
CPU machine runs the rest of the suite and reports these as skipped by name. Run the tier on a
GPU machine with `python -m pytest tests/gpu` (tests/gpu/run_on_gpu_machine.sh for a machine with
PyTorch but no package registry).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the gpu tier runs on a machine with a GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
