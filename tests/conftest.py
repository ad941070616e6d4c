"""What every test session shares: its own cache of this machine's figures.

The `local` cluster preset prices plans from this machine's measured figures, cached in
$MESHPLAN_CACHE_DIR (cost_models/local_machine.py; default ~/.cache/meshplan). A test must never
read the user's cache: one written while the machine was busy (a loopback latency of 41 us instead
of about 3 us) changed the plans three tests expected. So each session points MESHPLAN_CACHE_DIR
at a temporary directory of its own, which the processes the tests start inherit, and removes it at
the end; the first test that needs the figures measures them there. Tests whose expectations
depend on the relative prices of compute and communication use fixed figures instead
(tests/fixed_machine.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from cost_models.local_machine import CACHE_DIR_ENV

_SESSION_CACHE = pytest.StashKey[tuple[str, str | None]]()


def pytest_configure(config: pytest.Config) -> None:
    cache = tempfile.mkdtemp(prefix="meshplan-test-cache-")
    config.stash[_SESSION_CACHE] = (cache, os.environ.get(CACHE_DIR_ENV))
    os.environ[CACHE_DIR_ENV] = cache


def pytest_unconfigure(config: pytest.Config) -> None:
    cache, before = config.stash.get(_SESSION_CACHE, (None, None))
    if cache is None:
        return
    if before is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = before
    shutil.rmtree(cache, ignore_errors=True)
