"""benchmarks/accuracy.py picks its backend: MPI when it can launch MPI ranks, else gloo, saying why."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def accuracy():
    spec = importlib.util.spec_from_file_location("accuracy_bench", ROOT / "benchmarks" / "accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_default_backend_is_mpi_when_mpi4py_and_mpiexec_exist(accuracy, monkeypatch):
    import runtime.launcher

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mpi4py" else real(name, *a))
    monkeypatch.setattr(runtime.launcher, "mpiexec_path", lambda: "/opt/mpi/bin/mpiexec")
    assert accuracy.default_backend()[0] == "mpi"


def test_default_backend_falls_back_to_gloo_and_names_what_is_missing(accuracy, monkeypatch):
    import runtime.launcher

    real = importlib.util.find_spec
    monkeypatch.setattr(runtime.launcher, "mpiexec_path", lambda: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mpi4py" else real(name, *a))
    backend, why = accuracy.default_backend()
    assert backend == "gloo" and "mpiexec" in why
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    backend, why = accuracy.default_backend()
    assert backend == "gloo" and "mpi4py" in why

