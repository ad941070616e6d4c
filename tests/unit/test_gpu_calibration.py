"""GPU calibration without a GPU: the op rows measured (gpu_ops), their timing loop driven by a fake
and a host timer, the rates as the H100 table derives them, the one-device cluster file carrying
the rows (gpu_calibrate, Cluster's table measurements) and `meshplan calibrate --device`."""

import pytest
import torch

from cost_models.calibration import gpu_ops
from cost_models.calibration.calibrate import CalibrationError
from cost_models.calibration.gpu_calibrate import GpuInfo, calibration_device, gpu_cluster
from cost_models.calibration.gpu_families import FAMILIES, OpSpec, row_of
from cost_models.calibration.gpu_ops import Timer, _input_sets, gpu_op_specs, host_timer, measure_ops
from cost_models.gpu_costs import gpu_costs
from cost_models.cluster_file import ClusterFileError
from cost_models.hardware import Cluster
from cost_models.op_table import GPU_OPS_KEY, OpRow, format_op_table, measured_rows, parse_op_table
from planner.app import cli, verbs

# Rows of ../shared/reference/gpu/h100_ops.csv (one H100, H100.md): every family's rate as the table
# derives it from ms, and shapes the full calibration measures.
REFERENCE = """op,shape,dtype,ms,tflops,gbps
mm_fwd,qkv M2048 K768 N2304,bf16,0.03056,237.16,
mm_dgrad,qkv M2048 K2304 N768,bf16,0.02955,245.25,
mm_wgrad,qkv M2304 K2048 N768,bf16,0.03059,236.92,
mm_wgrad,fc2 M8192 K2048 N32768,bf16,1.62434,676.9,
mm_fwd,lm_head M16384 K768 N50257,bf16,13.18907,95.89,
mm_fwd,square M2048 K49152 N12288,bf16,3.34622,739.31,
mm_fwd,tf32 M4096 K4096 N4096,tf32,0.36824,373.23,
sdpa_fwd,B16 H12 T1024 D64 causal,bf16,0.10506,245.3,
sdpa_fwd_bwd,B2 H64 T4096 D128 causal,bf16,3.8149,504.38,
layernorm_fwd,N16384 h768,bf16,0.12179,,413.3
layernorm_fwd_bwd,N8192 h4096,bf16,0.59917,,672.0
gelu_fwd,N8192 h16384,bf16,0.20235,,2653.2
add,N16384 h8192,bf16,0.19962,,4034.3
xent_fp32_fwd_bwd,N8192 V128256,bf16->fp32,17.93323,,703.1
xent_bf16_fwd_bwd,N16384 V50257,bf16,4.21709,,1562.0
adamw_fused,params500000000 tensors100,fp32,6.21024,,2254.3
adamw_foreach,params10000000 tensors100,fp32,1.89155,,148.0
copy_d2d,bytes268435456,u8,0.19021,,2822.5
copy_h2d_pinned,bytes268435456,u8,4.91611,,54.6
copy_h2d_pageable,bytes268435456,u8,14.92912,,18.0
launch_1000_small_adds,16 floats,fp32,10.14148,,
"""

# Every family at a size this CPU runs in milliseconds.
TINY = [OpSpec("mm_fwd", "qkv M8 K16 N48"), OpSpec("mm_dgrad", "qkv M8 K48 N16"), OpSpec("mm_wgrad", "qkv M48 K8 N16"),
        OpSpec("mm_fwd", "fp32 M8 K8 N8", "fp32"), OpSpec("mm_fwd", "tf32 M8 K8 N8", "tf32"),
        OpSpec("mm_fwd", "fp16 M8 K8 N8", "fp16"), OpSpec("sdpa_fwd", "B1 H2 T16 D8 causal"),
        OpSpec("sdpa_fwd_bwd", "B1 H2 T16 D8 causal"), OpSpec("layernorm_fwd", "N8 h16"),
        OpSpec("layernorm_fwd_bwd", "N8 h16"), OpSpec("gelu_fwd", "N8 h64"), OpSpec("add", "N8 h16"),
        OpSpec("add_residual", "N8 h16"), OpSpec("xent_fp32_fwd_bwd", "N8 V50", "bf16->fp32"),
        OpSpec("xent_bf16_fwd_bwd", "N8 V50"), OpSpec("xent_compiled_fwd_bwd", "N8 V50", "bf16->fp32"),
        OpSpec("adamw_fused", "params1000 tensors10", "fp32"),
        OpSpec("adamw_foreach", "params1000 tensors10", "fp32"), OpSpec("copy_d2d", "bytes4096", "u8"),
        OpSpec("copy_h2d_pinned", "bytes4096", "u8"), OpSpec("copy_h2d_pageable", "bytes4096", "u8"),
        OpSpec("launch_1000_small_adds", "16 floats", "fp32"), OpSpec("host_linear_fwd_bwd", "M16 K16 N16", "fp32"),
        OpSpec("host_linear_fwd_bwd", "M16 K16 N16", "bf16"), OpSpec("host_item_sync", "1 float", "fp32")]


def _specs(quick):
    return [s for _, specs in gpu_op_specs(quick) for s in specs]


def test_rates_are_derived_as_the_reference_table_derives_them():
    for ref in parse_op_table(REFERENCE):
        got = row_of(OpSpec(ref.op, ref.shape, ref.dtype), ref.ms)
        if ref.tflops is None and ref.gbps is None:
            assert got.tflops is None and got.gbps is None, ref
        else:
            want, have = (ref.tflops, got.tflops) if ref.tflops is not None else (ref.gbps, got.gbps)
            assert have == pytest.approx(want, rel=2e-3), ref


def test_both_modes_measure_every_family_the_full_one_every_reference_shape():
    quick, full = _specs(True), _specs(False)
    assert {s.op for s in quick} == {s.op for s in full} == set(FAMILIES)
    assert set(quick) < set(full) and len(set(full)) == len(full)
    for ref in parse_op_table(REFERENCE):
        assert OpSpec(ref.op, ref.shape, ref.dtype) in full, ref
    # the vocabulary cliff, both head dimensions, both loss dtypes are in the quick mode too
    assert {"lm_head M8192 K768 N50257", "lm_head M8192 K768 N50304"} <= {s.shape for s in quick}
    assert {s.dims["D"] for s in quick if s.op == "sdpa_fwd"} == {64, 128}
    # the reference's 162 GEMM rows (64 bf16 mm_fwd, 48 mm_dgrad, 48 mm_wgrad, fp32, tf32) and fp16
    assert sum(s.op.startswith("mm_") for s in full) == 64 + 48 + 48 + 2 + 1


def test_the_timing_loop_warms_up_then_takes_the_median_of_marked_calls():
    clock = {"t": 0.0}
    calls = []
    syncs = []

    def call(i):                     # call i takes i ms on the fake device
        calls.append(i)
        clock["t"] += i

    timer = Timer(mark=lambda: clock["t"], ms=lambda a, b: b - a, sync=lambda: syncs.append(len(calls)))
    assert timer.device_ms(call, warmup=2, repeat=3) == 3.0       # calls 2, 3, 4: median 3 ms
    # the device idle before each timed call (a sync before it), and at the end
    assert calls == [0, 1, 2, 3, 4] and syncs == [2, 3, 4, 5]
    calls.clear()
    assert timer.host_ms(lambda i: calls.append(i), warmup=1, repeat=2) >= 0.0
    assert calls == [0, 1, 2]


def test_small_inputs_rotate_past_the_cache():
    made = []

    def make():
        made.append(1)
        return (torch.zeros(250),)            # 1000 bytes

    assert len(_input_sets(make, True, cache_bytes=4000)) == 8        # 2 x 4000 bytes
    assert len(_input_sets(make, True, cache_bytes=10**9)) == gpu_ops.MAX_COPIES
    assert len(_input_sets(make, False, cache_bytes=4000)) == 1
    assert len(_input_sets(make, True, cache_bytes=0)) == 1


def test_every_family_runs_and_makes_a_table_row_on_cpu():
    """Each family's inputs and call (what runs on the GPU), timed on this CPU with the host timer."""
    rows = measure_ops([("every family", TINY)], torch.device("cpu"), host_timer(), warmup=0, repeat=1,
                       cache_bytes=1 << 14, progress=None)
    assert [(r.op, r.shape, r.dtype) for r in rows] == [(s.op, s.shape, s.dtype) for s in TINY]
    for r in rows:
        assert r.ms > 0
        assert (r.tflops is not None) == (FAMILIES[r.op].rate == "tflops")
        assert (r.gbps is not None) == (FAMILIES[r.op].rate == "gbps")
    back = parse_op_table(format_op_table(rows))
    assert [(r.op, r.shape, r.dtype) for r in back] == [(r.op, r.shape, r.dtype) for r in rows]


def test_the_tf32_rows_switch_tf32_and_restore_it():
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    seen = []
    with FAMILIES["mm_fwd"].context(OpSpec("mm_fwd", "tf32 M8 K8 N8", "tf32")):
        seen.append(flags.allow_tf32)
    with FAMILIES["mm_fwd"].context(OpSpec("mm_fwd", "fp32 M8 K8 N8", "fp32")):
        seen.append(flags.allow_tf32)
    assert seen == [True, False] and flags.allow_tf32 == before


def test_measure_gpu_ops_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA kernels"):
        gpu_ops.measure_gpu_ops(torch.device("cpu"), quick=True)


# --- the cluster file -----------------------------------------------------------------------------

H100 = GpuInfo("NVIDIA H100 80GB HBM3", 132, 85_520_809_984, "2.11.0+cu130", "13.0")


def _rows():
    rows = parse_op_table(REFERENCE)
    return rows + [OpRow("host_linear_fwd_bwd", "M16 K16 N16", "bf16", 0.1), OpRow("mm_fwd", "fp16 M8 K8 N8", "fp16",
                                                                                     1.0, tflops=500.0)]


def _no_fit(rows, device, progress):
    return {}


def test_gpu_cluster_describes_the_device_and_keeps_every_row(tmp_path):
    cl = gpu_cluster(_rows(), H100, quick=True, seconds=42.0, fit=_no_fit, progress=None)
    d = cl.device
    assert d.kind == "gpu" and d.name == H100.name and d.compute_units == 132 and d.memory_bytes == H100.memory_bytes
    # an H100: the dgx-h100 preset's nominal peaks and bandwidth, so its fit is a fraction of the same figures
    preset = Cluster.preset("dgx-h100").device
    assert d.peak_flops == preset.peak_flops and d.memory_bandwidth == preset.memory_bandwidth
    assert "nominal" in cl.source
    assert d.active_watts == 700.0            # the dgx-h100 preset's, as are the links
    assert cl.intra_node == Cluster.preset("dgx-h100").intra_node and cl.num_devices == 1
    m = dict(cl.measurements)
    assert m["calibration.device"] == "cuda" and "not measured" in m["calibration.collectives"]
    assert measured_rows(cl.measurements) == _rows()
    for suffix in (".yaml", ".json"):
        cl.save(tmp_path / f"c{suffix}")
        back = Cluster.load(tmp_path / f"c{suffix}")
        assert back == cl and measured_rows(back.measurements) == _rows()
        assert hash(back) == hash(cl)


def test_an_unknown_gpu_gets_assumed_power_and_links_and_says_so():
    cl = gpu_cluster(_rows(), GpuInfo("Some Future GPU", 10, 2**30), quick=False, fit=_no_fit, progress=None)
    assert "power assumed" in cl.source and "links assumed" in cl.source
    # no preset of its model: the fastest measured GEMM per dtype and the measured copy
    d = cl.device
    assert d.peak("bf16") == pytest.approx(739.31e12) and d.peak("tf32") == pytest.approx(373.23e12)
    assert d.peak("fp16") == pytest.approx(500e12) and "fp32" not in d.dtypes
    assert d.memory_bandwidth == pytest.approx(2822.5e9)
    assert dict(cl.measurements)["calibration.mode"] == "full"


def test_a_cluster_needs_a_gemm_and_a_copy_row():
    with pytest.raises(CalibrationError, match="no GEMM"):
        gpu_cluster([r for r in _rows() if not r.op.startswith("mm_")], H100, quick=True, fit=_no_fit, progress=None)
    with pytest.raises(CalibrationError, match="copy_d2d"):
        gpu_cluster([r for r in _rows() if r.op != "copy_d2d"], H100, quick=True, fit=_no_fit, progress=None)


def test_the_fit_of_the_rows_is_merged_and_its_errors_are_said():
    said = []
    cl = gpu_cluster(_rows(), H100, quick=True, progress=said.append)
    m = dict(cl.measurements)
    costs = gpu_costs(cl)
    assert m["fit.gpu.source"].startswith("fit to") and measured_rows(cl.measurements)
    # a few of the reference rows: an H100's large-GEMM share (the whole table gives the preset's constants
    # back: tests/unit/test_gpu_fit.py)
    assert 0.6 < costs.gemm_ceiling < 0.9 and costs.host_op == pytest.approx(
        next(r for r in _rows() if r.op == "launch_1000_small_adds").seconds / 1000)
    assert any("median |err|" in line for line in said) and any(line.strip().startswith("gemm") for line in said)


def test_an_old_cluster_file_still_loads_and_bad_tables_are_named(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("""format_version: 1
name: local-calibrated
num_nodes: 1
devices_per_node: 2
device: {name: cpu, kind: cpu, peak_flops: {fp32: 5.0e10}, memory_bytes: 1000000000,
         memory_bandwidth: 1.0e10, active_watts: 6.75, idle_watts: 2.0}
intra_node: {bandwidth: 1.0e9, latency: 1.0e-5}
inter_node: {bandwidth: 1.0e9, latency: 1.0e-5}
measurements: {fit.eff.matmul: 0.5, calibration.backend: gloo, raw.comm.all_reduce.g2.8: 3.0e-5}
""")
    cl = Cluster.load(old)
    assert dict(cl.measurements)["fit.eff.matmul"] == 0.5 and measured_rows(cl.measurements) == []
    text = old.read_text().replace("raw.comm.all_reduce.g2.8: 3.0e-5}", "raw.gpu_ops: [{op: add, ms: [1]}]}")
    old.write_text(text)
    with pytest.raises(ClusterFileError, match=r"raw\.gpu_ops\[0\]\.ms"):
        Cluster.load(old)


# --- meshplan calibrate --device ------------------------------------------------------------------


def test_cli_refuses_cuda_without_a_cuda_device(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: this machine has no CUDA device" in err and "--device cpu" in err
    assert calibration_device("auto") == torch.device("cpu")
    with pytest.raises(CalibrationError, match="name auto, cpu, cuda"):
        calibration_device("tpu")


def test_cli_gpu_options_are_checked_before_measuring(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["calibrate", "--device", "cpu", "--op-table", str(tmp_path / "t.csv"),
                     "--out", str(tmp_path / "c.yaml")]) == 2
    assert "measured on a GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(verbs, "calibrate_gpu", lambda *a, **k: pytest.fail("measured before checking the options"))
    assert cli.main(["calibrate", "--device", "cuda", "--ranks", "2", "--out", str(tmp_path / "c.yaml")]) == 2
    assert "--ranks: a GPU calibration measures this one device" in capsys.readouterr().err
    assert cli.main(["calibrate", "--device", "cuda", "--op-table", str(tmp_path / "t.txt"),
                     "--out", str(tmp_path / "c.yaml")]) == 2
    assert "name the op table .csv" in capsys.readouterr().err


def test_cli_gpu_calibration_writes_the_cluster_and_the_op_table(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = {}

    def fake(device, *, quick, progress):
        asked.update(device=device, quick=quick)
        return gpu_cluster(_rows(), H100, quick=quick, fit=_no_fit, progress=progress)
    monkeypatch.setattr(verbs, "calibrate_gpu", fake)
    out, table = tmp_path / "h100.yaml", tmp_path / "ops" / "h100_ops.csv"
    assert cli.main(["calibrate", "--out", str(out), "--op-table", str(table), "--full"]) == 0
    assert asked == {"device": torch.device("cuda"), "quick": False}
    assert measured_rows(Cluster.load(out).measurements) == _rows()
    assert [(r.op, r.shape, r.ms) for r in parse_op_table(table.read_text())] == \
        [(r.op, r.shape, round(r.ms, 5)) for r in _rows()]
    assert f"wrote {table}" in capsys.readouterr().out
    assert GPU_OPS_KEY == "raw.gpu_ops"


def test_the_cuda_timer_reads_event_pairs_around_each_call(monkeypatch):
    """cuda_timer's glue (events on the current stream, elapsed_time, synchronize) over fake events."""
    device_ms = {"t": 0.0}
    synced = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream=None):
            self.at = device_ms["t"]

        def elapsed_time(self, other):
            return other.at - self.at
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))

    def call(i):
        device_ms["t"] += [5.0, 1.0, 2.0, 9.0][i]
    timer = gpu_ops.cuda_timer(torch.device("cuda"))
    assert timer.device_ms(call, warmup=1, repeat=3) == 2.0      # calls 1, 2, 3 took 1, 2 and 9 ms
    assert synced == [torch.device("cuda")] * 4                  # before each timed call, and at the end
