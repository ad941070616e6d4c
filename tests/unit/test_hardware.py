"""Cluster, Device and Link: presets, files, topology, the measured local preset."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cost_models import Cluster, ClusterFileError, Device, Link
from cost_models import local_machine

GiB = 2**30
GPU_PRESETS = ("dgx-a100-80gb", "dgx-h100", "summit")


@pytest.fixture(scope="module")
def measured_cache(tmp_path_factory):
    """Measure this machine once for the whole module; returns (cache dir, figures)."""
    cache_dir = tmp_path_factory.mktemp("meshplan-cache")
    return cache_dir, local_machine.load_or_measure(cache_dir)


@pytest.fixture
def local_env(measured_cache, monkeypatch):
    """Point the local preset at the module's measured cache."""
    cache_dir, figures = measured_cache
    monkeypatch.setenv(local_machine.CACHE_DIR_ENV, str(cache_dir))
    return cache_dir, figures


def fake_figures(**overrides):
    """A complete, valid local-machine record for this machine's key (no measuring)."""
    figures = {
        "format_version": local_machine.CACHE_FORMAT_VERSION,
        **local_machine.machine_key(),
        "usable_cpus": 2,
        "cpu_model": "test cpu",
        "memory_bytes": 16 * GiB,
        "fp32_flops": 100e9,
        "bf16_flops": 200e9,
        "fp16_flops": 2e9,
        "memory_bandwidth": 20e9,
        "link_bandwidth": 5e9,
        "link_latency": 10e-6,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),   # fresh: not stale
        "measure_seconds": 0.5,
    }
    figures.update(overrides)
    return figures


def write_cache(cache_dir: Path, figures) -> Path:
    path = cache_dir / local_machine.CACHE_FILE_NAME
    path.write_text(json.dumps(figures))
    return path


def fail_if_called():
    raise AssertionError("measure_local_machine was called, but the cache should have been used")


# --- presets -------------------------------------------------------------------------


def test_preset_names():
    assert Cluster.preset_names() == ("dgx-a100-80gb", "dgx-h100", "local", "summit")


def test_dgx_a100_constants():
    c = Cluster.preset("dgx-a100-80gb")
    d = c.device
    assert (c.num_nodes, c.devices_per_node, d.kind) == (1, 8, "gpu")
    assert d.peak("bf16") == d.peak("fp16") == 312e12
    assert d.peak("fp32") == 19.5e12 and d.peak("tf32") == 156e12
    assert d.memory_bytes == 80 * GiB == 81920 * 2**20
    assert d.memory_bandwidth == 2.0e12 and d.active_watts == 400
    assert c.intra_node.bandwidth == 300e9 and c.inter_node.bandwidth == 25e9


def test_dgx_h100_constants():
    c = Cluster.preset("dgx-h100")
    d = c.device
    assert c.devices_per_node == 8
    assert d.peak("bf16") == d.peak("fp16") == 989e12 and d.peak("fp8") == 1979e12
    assert d.peak("fp32") == 67e12
    assert d.memory_bytes == 80 * GiB and d.memory_bandwidth == 3.35e12
    assert d.active_watts == 700
    assert c.intra_node.bandwidth == 450e9 and c.inter_node.bandwidth == 50e9


def test_summit_constants():
    c = Cluster.preset("summit")
    d = c.device
    assert c.devices_per_node == 6
    assert d.peak("fp16") == 125e12 and d.peak("fp32") == 15.7e12
    assert d.memory_bytes == 16 * GiB and d.memory_bandwidth == 900e9
    assert d.active_watts == 300
    assert c.intra_node.bandwidth == 50e9
    assert c.inter_node.bandwidth == 25e9 / 6  # 2 x 100 Gb/s per node, shared by 6 GPUs


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_presets_are_sane(name):
    c = Cluster.preset(name)
    assert c.source
    assert 0 < c.device.idle_watts < c.device.active_watts
    assert 0 < c.intra_node.latency < c.inter_node.latency < 1e-4
    assert c.inter_node.bandwidth < c.intra_node.bandwidth
    hash(c)  # a value: usable as a dict key


def test_preset_sizes():
    assert Cluster.preset("dgx-h100", nodes=4).num_devices == 32
    c = Cluster.preset("dgx-a100-80gb", devices=4)
    assert (c.num_nodes, c.devices_per_node) == (1, 4)
    c = Cluster.preset("summit", nodes=2, devices=3)
    assert (c.num_nodes, c.devices_per_node, c.num_devices) == (2, 3, 6)


def test_preset_too_many_devices():
    with pytest.raises(ValueError, match="8 GPUs per node"):
        Cluster.preset("dgx-a100-80gb", devices=9)
    with pytest.raises(ValueError, match="6 GPUs per node"):
        Cluster.preset("summit", devices=12)


@pytest.mark.parametrize(
    "kwargs", [{"nodes": 0}, {"devices": 0}, {"nodes": 1.5}, {"devices": True}]
)
def test_preset_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        Cluster.preset("dgx-h100", **kwargs)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError) as info:
        Cluster.preset("dgx-a100")
    message = str(info.value)
    assert "'dgx-a100'" in message
    for name in Cluster.preset_names():
        assert name in message


# --- device, link, topology -------------------------------------------------------------


def test_device_peak_and_aliases():
    d = Cluster.preset("dgx-a100-80gb").device
    assert d.dtypes == ("bf16", "fp16", "fp32", "tf32")
    assert d.peak("bfloat16") == d.peak("torch.bfloat16") == 312e12


def test_device_peak_unknown_dtype_names_it_and_the_known_ones():
    d = Cluster.preset("summit").device
    with pytest.raises(ValueError) as info:
        d.peak("bf16")
    message = str(info.value)
    assert "'bf16'" in message and "fp16" in message and "fp32" in message


def test_device_accepts_a_dict_and_stays_hashable():
    kwargs = dict(
        name="x", memory_bytes=GiB, memory_bandwidth=1e9, active_watts=10, idle_watts=1, kind="cpu"
    )
    a = Device(peak_flops={"fp32": 1e9, "bf16": 2e9}, **kwargs)
    b = Device(peak_flops=(("bf16", 2e9), ("fp32", 1e9)), **kwargs)
    assert a == b and hash(a) == hash(b)
    assert a.peak_flops == (("bf16", 2e9), ("fp32", 1e9))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"memory_bytes": -1}, "Device.memory_bytes"),
        ({"memory_bandwidth": 0}, "Device.memory_bandwidth"),
        ({"peak_flops": {"fp23": 1e9}}, "Device.peak_flops.fp23"),
        ({"peak_flops": {}}, "Device.peak_flops"),
        ({"idle_watts": 20}, "Device.idle_watts"),
        ({"kind": "tpu"}, "Device.kind"),
    ],
)
def test_device_rejects_bad_values(change, field):
    kwargs = dict(name="x", peak_flops={"fp32": 1e9}, memory_bytes=GiB, memory_bandwidth=1e9,
                  active_watts=10, idle_watts=1, kind="cpu")
    kwargs.update(change)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Device(**kwargs)


def test_link_time():
    link = Link(bandwidth=25e9, latency=6e-6)
    assert link.time(0) == 6e-6
    assert link.time(25e9) == pytest.approx(1 + 6e-6)
    with pytest.raises(ValueError):
        link.time(-1)
    with pytest.raises(ValueError, match="Link.bandwidth"):
        Link(bandwidth=-1, latency=0)


def test_node_of_is_node_major():
    c = Cluster.preset("summit", nodes=3)
    assert [c.node_of(r) for r in range(18)] == [r // 6 for r in range(18)]
    for bad in (-1, 18):
        with pytest.raises(ValueError, match="0..17"):
            c.node_of(bad)


def test_link_between_and_for_group():
    c = Cluster.preset("dgx-a100-80gb", nodes=2)
    assert c.link_between(0, 7) == c.intra_node
    assert c.link_between(7, 8) == c.inter_node
    assert c.link_for_group([0]) == c.intra_node
    assert c.link_for_group(range(8)) == c.intra_node
    assert c.link_for_group(range(8, 16)) == c.intra_node
    assert c.link_for_group([3, 11]) == c.inter_node
    assert c.link_for_group(range(16)) == c.inter_node
    with pytest.raises(ValueError):
        c.link_for_group([])
    with pytest.raises(ValueError):
        c.link_for_group([0, 16])


def test_summary_is_readable():
    text = Cluster.preset("dgx-h100", nodes=2).summary()
    assert "dgx-h100" in text and "16 device(s)" in text
    assert "989 TFLOP/s" in text and "450 GB/s" in text and "50 GB/s" in text
    assert len(text.splitlines()) >= 5


# --- files -------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
@pytest.mark.parametrize("name", Cluster.preset_names())
def test_round_trip_is_exact(name, suffix, tmp_path, local_env):
    c = Cluster.preset(name, devices=2) if name != "dgx-h100" else Cluster.preset(name, nodes=3)
    path = tmp_path / f"cluster{suffix}"
    c.save(path)
    back = Cluster.load(path)
    assert back == c and hash(back) == hash(c)
    assert Cluster.from_dict(c.to_dict()) == c
    if name == "local":
        assert dict(back.measurements) == dict(c.measurements) != {}


def test_measurements_survive_round_trip(tmp_path):
    c = Cluster.preset("summit")
    raw = {"allreduce_1MiB_s": 1.2345678901234567e-4, "runs": 7, "note": "x"}
    c = dataclasses.replace(c, measurements=raw)
    for suffix in (".yaml", ".json"):
        c.save(tmp_path / f"c{suffix}")
        back = Cluster.load(tmp_path / f"c{suffix}")
        assert back == c
        assert dict(back.measurements) == raw
        assert isinstance(dict(back.measurements)["runs"], int)


def test_hand_written_yaml_with_natural_float_spellings(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "name: two-boxes\nnum_nodes: 2\ndevices_per_node: 4\n"
        "device: {name: A100, kind: gpu, peak_flops: {bf16: 312e12}, memory_bytes: 80e9,\n"
        "         memory_bandwidth: 2e12, active_watts: 400, idle_watts: 50}\n"
        "intra_node: {bandwidth: 300e9, latency: 3e-6}\n"
        "inter_node: {bandwidth: 25e9, latency: 6e-6}\n"
    )
    c = Cluster.load(path)
    assert c.device.peak("bf16") == 312e12 and c.device.memory_bytes == 80_000_000_000
    assert c.inter_node.latency == 6e-6 and c.num_devices == 8
    assert c.source == "" and c.measurements == ()


@pytest.mark.parametrize("content", ["json", "yaml"])
def test_load_unknown_suffix_tries_json_then_yaml(content, tmp_path):
    c = Cluster.preset("summit")
    path = tmp_path / "cluster.txt"
    text = json.dumps(c.to_dict()) if content == "json" else yaml.safe_dump(c.to_dict())
    path.write_text(text)
    assert Cluster.load(path) == c


def test_save_rejects_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"\.yaml, \.yml or \.json"):
        Cluster.preset("summit").save(tmp_path / "cluster.txt")


def edited_file(tmp_path, edit, suffix=".yaml") -> Path:
    """Save a preset, apply ``edit`` to its dict, write it back; returns the path."""
    data = Cluster.preset("dgx-a100-80gb", nodes=2).to_dict()
    edit(data)
    path = tmp_path / f"broken{suffix}"
    text = json.dumps(data) if suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
    return path


def assert_names_field_and_file(info, field, path):
    message = str(info.value)
    assert f"'{field}'" in message, message
    assert str(path) in message, message
    assert info.value.field == field and info.value.path == str(path)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_missing_field_names_field_and_file(tmp_path, suffix):
    path = edited_file(tmp_path, lambda d: d["device"].pop("memory_bytes"), suffix)
    with pytest.raises(ClusterFileError, match="is missing") as info:
        Cluster.load(path)
    assert_names_field_and_file(info, "device.memory_bytes", path)
    assert "Add it" in str(info.value)


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("inter_node", "bandwidth", -25e9),
        ("device", "memory_bytes", 0),
        ("intra_node", "latency", -1e-6),
        (None, "num_nodes", -2),
    ],
)
def test_negative_or_zero_field_names_field_and_file(tmp_path, section, key, value):
    def edit(d):
        (d[section] if section else d)[key] = value

    path = edited_file(tmp_path, edit)
    with pytest.raises(ClusterFileError) as info:
        Cluster.load(path)
    field = f"{section}.{key}" if section else key
    assert_names_field_and_file(info, field, path)
    assert "Correct it in the file" in str(info.value)


def test_misspelled_field_suggests_closest_name(tmp_path):
    def misspell(d):
        d["device"]["memroy_bytes"] = d["device"].pop("memory_bytes")

    path = edited_file(tmp_path, misspell)
    with pytest.raises(ClusterFileError) as info:
        Cluster.load(path)
    assert_names_field_and_file(info, "device.memroy_bytes", path)
    assert "Did you mean 'device.memory_bytes'?" in str(info.value)


def test_misspelled_top_level_field_and_dtype(tmp_path):
    path = edited_file(tmp_path, lambda d: d.update(num_node=d.pop("num_nodes")))
    with pytest.raises(ClusterFileError, match="Did you mean 'num_nodes'"):
        Cluster.load(path)
    path = edited_file(tmp_path, lambda d: d["device"]["peak_flops"].update(bf61=1e12))
    with pytest.raises(ClusterFileError, match="Did you mean 'bf16'") as info:
        Cluster.load(path)
    assert_names_field_and_file(info, "device.peak_flops.bf61", path)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.update(num_nodes="two"), "num_nodes"),
        (lambda d: d["device"].update(memory_bandwidth="fast"), "device.memory_bandwidth"),
        (lambda d: d["device"].update(memory_bytes=True), "device.memory_bytes"),
        (lambda d: d.update(intra_node=[1, 2]), "intra_node"),
        (lambda d: d.update(format_version=2), "format_version"),
        (lambda d: d.update(measurements={"x": [1, 2]}), "measurements.x"),
    ],
)
def test_wrong_type_names_field_and_file(tmp_path, edit, field):
    path = edited_file(tmp_path, edit)
    with pytest.raises(ClusterFileError) as info:
        Cluster.load(path)
    assert_names_field_and_file(info, field, path)


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ClusterFileError, match="does not exist") as info:
        Cluster.load(path)
    assert str(path) in str(info.value)


def test_unparsable_or_non_mapping_file(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    with pytest.raises(ClusterFileError, match="does not parse") as info:
        Cluster.load(bad_json)
    assert str(bad_json) in str(info.value)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ClusterFileError, match="mapping"):
        Cluster.load(listed)


def test_from_dict_without_a_file_still_names_the_field():
    data = Cluster.preset("summit").to_dict()
    del data["inter_node"]["latency"]
    with pytest.raises(ClusterFileError, match="'inter_node.latency'"):
        Cluster.from_dict(data)


# --- the measured local preset ------------------------------------------------------


def test_import_does_no_work(tmp_path):
    # A fresh interpreter: importing the package must not measure, cache or load torch.
    env = {**os.environ, local_machine.CACHE_DIR_ENV: str(tmp_path)}
    code = "import sys, cost_models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], check=True)
    assert out.stdout.strip() == "False"
    assert list(tmp_path.iterdir()) == []


def test_local_measured_figures_are_plausible(measured_cache):
    cache_dir, m = measured_cache
    assert m["measure_seconds"] > 0   # how long is the machine's to say; the budgets are tested below
    assert 1e8 < m["fp32_flops"] < 1e13  # one core: 0.1 GFLOP/s .. 10 TFLOP/s
    # 16-bit products: measured, never assumed; a CPU without fp16 kernels may be far below 0.1 GFLOP/s
    assert 1e6 < m["bf16_flops"] < 1e14 and 1e6 < m["fp16_flops"] < 1e14
    assert 1e8 < m["memory_bandwidth"] < 1e12
    assert 1e7 < m["link_bandwidth"] < 1e12
    assert 1e-7 < m["link_latency"] < 1e-2
    assert m["memory_bytes"] > 2**28
    assert m["usable_cpus"] >= 1 and m["cpu_count"] == os.cpu_count()
    saved = json.loads((cache_dir / local_machine.CACHE_FILE_NAME).read_text())
    assert saved == m


def test_each_timing_stops_once_its_budget_is_spent(monkeypatch):
    """With a clock the test controls (each call of the timed function takes 0.25 s), a part
    times at most as many calls as fit in its budget, and always one."""
    now = [0.0]
    monkeypatch.setattr(local_machine.time, "perf_counter", lambda: now[0])
    calls = []

    def fn():
        calls.append(now[0])
        now[0] += 0.25

    assert local_machine._best_time(fn, repeats=10, budget_s=0.6) == 0.25
    assert len(calls) == 1 + 3          # the warm-up, then calls until the deadline (0.6 s) is passed
    calls.clear()
    local_machine._best_time(fn, repeats=10, budget_s=0.0)
    assert len(calls) == 1 + 1


def test_local_preset_two_devices(local_env):
    _, m = local_env
    c = Cluster.preset("local", devices=2)
    assert (c.name, c.num_nodes, c.devices_per_node) == ("local", 1, 2)
    d = c.device
    assert d.kind == "cpu" and d.dtypes == ("bf16", "fp16", "fp32")
    share = min(1.0, m["usable_cpus"] / 2)
    assert d.peak("fp32") == m["fp32_flops"] * share
    assert (d.peak("bf16"), d.peak("fp16")) == (m["bf16_flops"] * share, m["fp16_flops"] * share)
    assert d.memory_bandwidth == m["memory_bandwidth"] * share
    assert d.memory_bytes == m["memory_bytes"] // 2
    assert c.intra_node == c.inter_node == Link(m["link_bandwidth"], m["link_latency"])
    assert 0 < d.idle_watts < d.active_watts
    assert dict(c.measurements) == m


def test_local_second_call_uses_the_cache(local_env, monkeypatch):
    cache_dir, _ = local_env
    cache_file = cache_dir / local_machine.CACHE_FILE_NAME
    mtime = cache_file.stat().st_mtime_ns
    first = Cluster.preset("local", devices=2)
    monkeypatch.setattr(local_machine, "measure_local_machine", fail_if_called)
    assert Cluster.preset("local", devices=2) == first
    assert cache_file.stat().st_mtime_ns == mtime


def test_local_default_is_one_process_per_cpu(local_env):
    _, m = local_env
    assert Cluster.preset("local").num_devices == m["usable_cpus"]


def test_local_oversubscribed_processes_share_the_cpus(tmp_path, monkeypatch):
    write_cache(tmp_path, fake_figures(usable_cpus=2))
    monkeypatch.setenv(local_machine.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(local_machine, "measure_local_machine", fail_if_called)
    d = Cluster.preset("local", devices=8).device
    assert d.peak("fp32") == 100e9 / 4  # 8 processes on 2 CPUs: a quarter each
    assert d.memory_bandwidth == 20e9 / 4
    assert d.memory_bytes == 2 * GiB


def test_local_rejects_more_than_one_node(local_env):
    with pytest.raises(ValueError, match="nodes must be 1"):
        Cluster.preset("local", nodes=2, devices=2)


@pytest.mark.parametrize(
    "stale",
    [
        json.dumps(fake_figures(hostname="some-other-host")),
        json.dumps(fake_figures(torch_version="0.0.1")),
        json.dumps(fake_figures(cpu_count=10_000)),
        json.dumps(fake_figures(fp32_flops=-1)),
        json.dumps({k: v for k, v in fake_figures().items() if k != "link_latency"}),
        "{truncated",
    ],
)
def test_local_remeasures_on_stale_or_broken_cache(tmp_path, monkeypatch, stale):
    (tmp_path / local_machine.CACHE_FILE_NAME).write_text(stale)
    calls = []
    fresh = fake_figures(cpu_model="freshly measured")
    monkeypatch.setattr(local_machine, "measure_local_machine", lambda: calls.append(1) or fresh)
    assert local_machine.load_or_measure(tmp_path) == fresh
    assert calls == [1]
    # ... and the cache now holds the fresh figures.
    assert json.loads((tmp_path / local_machine.CACHE_FILE_NAME).read_text()) == fresh


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv(local_machine.CACHE_DIR_ENV, str(tmp_path))
    assert local_machine.default_cache_dir() == tmp_path
    monkeypatch.delenv(local_machine.CACHE_DIR_ENV)
    assert local_machine.default_cache_dir() == Path.home() / ".cache" / "meshplan"
