"""benchmarks/published_memory.py: its table of published peak-memory rows loads (the errors are the
benchmark's output, not tested)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import published_memory as pm  # noqa: E402


@pytest.mark.parametrize("row", pm.ROWS, ids=lambda r: r.run)
def test_every_row_names_its_source_and_runs_on_its_gpus(row):
    assert row.source and row.measure and row.note
    assert row.model in pm.MODELS
    assert 10 * pm.GiB < row.published < 100 * pm.GiB   # one GPU's memory, in bytes
    assert pm.config_of(row).num_devices == row.gpus
    assert pm.cluster_of(row).num_devices == row.gpus


def test_a_row_whose_degrees_miss_its_gpus_is_refused_by_name():
    row = pm.ROWS[0]
    bad = dataclasses.replace(row, gpus=row.gpus * 2)
    with pytest.raises(ValueError, match="BLOOM-176B.*multiply to 384 devices, not 768"):
        pm.config_of(bad)
    with pytest.raises(ValueError, match="not a whole number"):
        pm.cluster_of(dataclasses.replace(row, gpus=12))


def test_torchtitan_rows_run_on_its_96_gb_gpus_and_the_8b_under_its_own_selective_policy():
    from cost_models.activations import SelectivePolicy

    titan = [r for r in pm.ROWS if "torchtitan" in r.run]
    assert titan and all(r.device_memory == 96 * pm.GB for r in titan)
    selective = [r for r in titan if r.config.get("recompute") == "selective"]
    assert selective and all(r.evaluator["selective"] is SelectivePolicy.ALTERNATE_MATMULS for r in selective)
