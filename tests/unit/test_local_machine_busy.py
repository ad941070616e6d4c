"""The local machine's figures survive a busy machine (cost_models/local_machine.py): a reading is
measured again when stale, implausible, or taken while busy, a busy reading measured again keeps the
better value of each figure, and `meshplan cluster local --remeasure` measures now. No test here
measures the machine, except the loopback probe's own shape."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cost_models import Cluster, local_machine
from planner.app.cli import main
from tests.fixed_machine import FIGURES


def record(**overrides):
    """A cache record of this machine, measured a minute ago (now, not at import: a long suite may run this
    test more than BUSY_RETRY_S after it imported the module) on a quiet machine."""
    return {"format_version": local_machine.CACHE_FORMAT_VERSION, **local_machine.machine_key(), **FIGURES,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 60)), **overrides}


def ago(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - seconds))


@pytest.mark.parametrize("overrides, why", [
    ({}, None),
    ({"measured_at": ago(31 * 86400)}, "stale"),
    ({"measured_at": "not a time"}, "stale"),
    ({"link_latency": 2e-3}, "implausible link_latency"),
    ({"fp32_flops": 1e14}, "implausible fp32_flops"),
    ({"load_per_cpu": 3.0}, None),                                     # busy, but measured a minute ago
    ({"load_per_cpu": 3.0, "measured_at": ago(700)}, "busy"),           # busy and older than BUSY_RETRY_S
    ({"latency_spread": 5.0, "measured_at": ago(700)}, "busy"),
    ({"load_per_cpu": 0.5, "latency_spread": 1.2, "measured_at": ago(700)}, None),
])
def test_why_a_cached_reading_is_measured_again(overrides, why):
    got = local_machine.why_remeasure(record(**overrides), now=time.time())
    assert (got is None) if why is None else got.startswith(why), got


def test_a_busy_reading_measured_again_keeps_the_better_value_of_each_figure(tmp_path, monkeypatch):
    busy = record(link_latency=41e-6, fp32_flops=1.5e10, link_bandwidth=4e9, load_per_cpu=4.0, measured_at=ago(700))
    (tmp_path / local_machine.CACHE_FILE_NAME).write_text(json.dumps(busy))
    fresh = record(link_latency=3.5e-6, fp32_flops=1.9e10, link_bandwidth=3e9, load_per_cpu=2.0)
    monkeypatch.setattr(local_machine, "measure_local_machine", lambda: dict(fresh))
    got = local_machine.load_or_measure(tmp_path)
    assert (got["link_latency"], got["fp32_flops"], got["link_bandwidth"]) == (3.5e-6, 1.9e10, 4e9)
    assert local_machine.is_busy(got)      # both readings were busy: it is tried again later
    assert json.loads((tmp_path / local_machine.CACHE_FILE_NAME).read_text()) == got


def test_a_quiet_fresh_reading_is_used_and_remeasure_ignores_it(tmp_path, monkeypatch):
    (tmp_path / local_machine.CACHE_FILE_NAME).write_text(json.dumps(record(link_latency=41e-6, load_per_cpu=3.0)))
    calls = []
    monkeypatch.setattr(local_machine, "measure_local_machine", lambda: calls.append(1) or record())
    assert local_machine.load_or_measure(tmp_path)["link_latency"] == 41e-6 and not calls
    assert local_machine.load_or_measure(tmp_path, remeasure=True)["link_latency"] == FIGURES["link_latency"]
    assert calls == [1]   # measured, and not merged with the busy reading


def test_a_cache_of_the_format_before_busy_was_recorded_is_measured_again(tmp_path, monkeypatch):
    old = record(format_version=2, link_latency=41e-6)
    (tmp_path / local_machine.CACHE_FILE_NAME).write_text(json.dumps(old))
    monkeypatch.setattr(local_machine, "measure_local_machine", lambda: record())
    assert local_machine.load_or_measure(tmp_path)["link_latency"] == FIGURES["link_latency"]


def test_the_loopback_probe_reports_how_much_its_rounds_disagree():
    latency, bandwidth, spread = local_machine._measure_loopback_tcp()
    assert 0 < latency < 1e-2 and bandwidth > 0 and spread >= 1.0


def test_meshplan_cluster_local_remeasure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(local_machine.CACHE_DIR_ENV, str(tmp_path))
    (tmp_path / local_machine.CACHE_FILE_NAME).write_text(json.dumps(record(link_latency=41e-6)))
    monkeypatch.setattr(local_machine, "measure_local_machine", lambda: record(link_latency=4e-6))
    assert main(["cluster", "local", "--devices", "2", "--remeasure"]) == 0
    out = capsys.readouterr().out
    assert "measured this machine now" in out and "4 us latency" in out
    assert json.loads((tmp_path / local_machine.CACHE_FILE_NAME).read_text())["link_latency"] == 4e-6
    assert main(["cluster", "dgx-h100", "--remeasure"]) == 2
    assert "--remeasure measures this machine" in capsys.readouterr().err


def test_fixed_figures_make_a_local_cluster_without_measuring(monkeypatch):
    monkeypatch.setattr(local_machine, "load_or_measure", lambda *a, **k: pytest.fail("measured"))
    c = Cluster.preset("local", devices=4, figures=record())
    assert c.device.peak("fp32") == FIGURES["fp32_flops"] / 2 and c.intra_node.latency == FIGURES["link_latency"]
    with pytest.raises(ValueError, match="figures describe this machine for the 'local' preset"):
        Cluster.preset("dgx-h100", figures=record())


def test_tests_never_read_the_users_cache():
    """tests/conftest.py: this session's own temporary cache directory, not ~/.cache/meshplan."""
    here = local_machine.default_cache_dir()
    assert here.name.startswith("meshplan-test-cache-") and here.is_dir()
    assert here != Path.home() / ".cache" / "meshplan"


def test_compiled_tests_never_read_another_run_s_compile_cache():
    """tests/conftest.py: torch.compile's caches live in the session's directory too, not /tmp's shared one."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    session = local_machine.default_cache_dir()
    assert Path(cache_dir()).parent == session
    assert Path(os.environ["TRITON_CACHE_DIR"]).parent == session
