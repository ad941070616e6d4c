"""What every test session shares: its own cache of this machine's figures.

The `local` cluster preset prices plans from this machine's measured figures, cached in
$MESHPLAN_CACHE_DIR (cost_models/local_machine.py; default ~/.cache/meshplan). A test must never
read the user's cache: one written while the machine was busy (a loopback latency of 41 us instead
of about 3 us) changed the plans three tests expected. So each session points MESHPLAN_CACHE_DIR
at a temporary directory of its own, which the processes the tests start inherit, and removes it at
the end; the first test that needs the figures measures them there. torch.compile's caches
(TorchInductor's and Triton's, in /tmp by default) are put there too, so a compiled test compiles from
scratch, as on a fresh machine, and never reads what another run left. Tests whose expectations
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
_COMPILE_BEFORE = pytest.StashKey[dict[str, str | None]]()
# torch.compile's on-disk caches (torch/_inductor/runtime/cache_dir_utils.py reads these at each use)
_COMPILE_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def pytest_configure(config: pytest.Config) -> None:
    cache = tempfile.mkdtemp(prefix="meshplan-test-cache-")
    config.stash[_SESSION_CACHE] = (cache, os.environ.get(CACHE_DIR_ENV))
    os.environ[CACHE_DIR_ENV] = cache
    config.stash[_COMPILE_BEFORE] = {var: os.environ.get(var) for var in _COMPILE_CACHES}
    for var, sub in _COMPILE_CACHES.items():
        os.environ[var] = os.path.join(cache, sub)


def pytest_unconfigure(config: pytest.Config) -> None:
    cache, before = config.stash.get(_SESSION_CACHE, (None, None))
    if cache is None:
        return
    for var, value in {CACHE_DIR_ENV: before, **config.stash.get(_COMPILE_BEFORE, {})}.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    shutil.rmtree(cache, ignore_errors=True)
