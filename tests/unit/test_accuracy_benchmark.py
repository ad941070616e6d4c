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
    import runtime.launch.launcher

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mpi4py" else real(name, *a))
    monkeypatch.setattr(runtime.launch.launcher, "mpiexec_path", lambda: "/opt/mpi/bin/mpiexec")
    assert accuracy.default_backend()[0] == "mpi"


def test_default_backend_falls_back_to_gloo_and_names_what_is_missing(accuracy, monkeypatch):
    import runtime.launch.launcher

    real = importlib.util.find_spec
    monkeypatch.setattr(runtime.launch.launcher, "mpiexec_path", lambda: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mpi4py" else real(name, *a))
    backend, why = accuracy.default_backend()
    assert backend == "gloo" and "mpiexec" in why
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    backend, why = accuracy.default_backend()
    assert backend == "gloo" and "mpi4py" in why



def test_the_median_launch_is_compared_and_a_disturbed_one_is_not(accuracy):
    assert accuracy._median_launch([43.0, 84.9, 42.1]) == 0
    assert accuracy._median_launch([84.9, 43.0]) == 1          # even: the lower middle one
    assert accuracy._median_launch([5.0]) == 0


def test_each_launch_is_kept_and_the_chosen_one_restored(accuracy, tmp_path):
    build = tmp_path / "build"
    (build / "run").mkdir(parents=True)
    for k in range(3):
        (build / "timeline.json").write_text(f'{{"launch": {k}}}')
        (build / "run" / "rank_0000.json").write_text(str(k))
        accuracy._keep_launch(build, k)
    accuracy._restore_launch(build, 1)
    assert (build / "timeline.json").read_text() == '{"launch": 1}'
    assert (build / "run" / "rank_0000.json").read_text() == "1"
    assert sorted(p.name for p in (build / "launches").iterdir()) == ["0", "1", "2"]
