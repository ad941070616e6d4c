"""benchmarks/published_runs.py: its rows are PUBLISHED.md's measured runs, its formulas and its
stack -> Evaluator options mapping. The errors themselves are what the benchmark reports, not asserted."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

import planner
from examples.models import gpt
from cost_models.overlap import Overlap
from planner.evaluator import Evaluator

ROOT = Path(__file__).resolve().parents[2]
# the project's public calibration set, kept in the repository (a copy of ../shared/reference/PUBLISHED.md)
PUBLISHED = ROOT / "docs" / "reference" / "PUBLISHED.md"


def _load():
    spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # its dataclasses look their module up there
    spec.loader.exec_module(mod)   # puts benchmarks/ on sys.path and imports published_rows
    return mod, sys.modules["published_rows"]


bench, rows = _load()


def _table(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first markdown table after `heading`, as stripped cells."""
    out: list[list[str]] = []
    for ln in text[text.index(heading):].splitlines():
        if ln.startswith("|"):
            out.append([c.strip() for c in ln.strip().strip("|").split("|")])
        elif out:
            break
    return out[2:]   # skip the header and the |---| line


def _numbers(cell: str) -> list[float]:
    """The leading number, or the slash-separated numbers, of a cell: "256 / 512" -> [256, 512],
    '"around 32 s" per iteration (138 ...)' -> [32]."""
    found = re.search(r"\d[\d.]*(?:\s*/\s*\d[\d.]*)*", cell)
    return [float(x) for x in found.group(0).split("/")]


@pytest.fixture(scope="module")
def published_text():
    return PUBLISHED.read_text()


def test_every_sc21_table2_row_is_a_benchmark_row(published_text):
    md = _table(published_text, "## Measured runs: Megatron-LM SC'21")
    assert len(md) == 12
    sc21 = [r for r in rows.RUNS if r.table == rows.Table.SC21]
    assert len(sc21) == len(md)
    for scheme, params, mp, batch, gpus, mb, tflops in md:
        match = [r for r in sc21 if (r.name, r.model, r.gpus) == (scheme, rows.SC21_PRESETS[float(params)], int(gpus))]
        assert len(match) == 1, (scheme, params, gpus)
        run = match[0]
        knobs = dict(run.knobs)
        assert (run.batch, knobs["micro_batch_size"], run.published) == (int(batch), int(mb), float(tflops))
        assert knobs.get("tensor", 1) * knobs.get("pipeline", 1) == int(mp)


def test_every_more_measured_run_is_a_benchmark_row(published_text):
    md = _table(published_text, "## More measured runs")
    more = [r for r in rows.RUNS if r.table == rows.Table.MORE]
    expected, name = [], None
    for cells in md:
        name = name if cells[0].startswith("same") else cells[0]   # "same, larger": the run above, more GPUs
        gpus, published = _numbers(cells[3]), _numbers(cells[11])
        assert len(gpus) == len(published)
        expected += [(name, int(g), p) for g, p in zip(gpus, published)]
        # the published degrees are the benchmark's knobs
        for g, tp, pp, dp in zip(gpus, _numbers(cells[4]), _numbers(cells[5]), _numbers(cells[6])):
            run = next(r for r in more if (r.name, r.gpus) == (name, int(g)))
            knobs = dict(run.knobs)
            assert (knobs["tensor"], knobs["pipeline"], knobs["data"]) == (tp, pp, dp)
            assert tp * pp * dp == run.gpus
    assert len(expected) == 11
    assert sorted((r.name, r.gpus, r.published) for r in more) == sorted(expected)


def test_paper_flop_formula_by_hand():
    # 96 * 2 * 12 * 2 * 4^2 = 73728; 1 + 12/(6*4) + 64/(16*2*4) = 2
    assert rows.paper_flops(batch=2, seq=12, layers=2, hidden=4, vocab=64) == 147456
    # the Megatron-LM README's GPT-3 example: 32 s per iteration on 1024 GPUs is "138 TFLOP/s per GPU":
    # 96*1536*2048*96*12288^2 * (1 + 2048/73728 + 51200/18874368) = 4.5110e18 FLOPs / (32 s * 1024)
    f = rows.paper_flops(batch=1536, seq=2048, layers=96, hidden=12288, vocab=51200)
    assert f == pytest.approx(4.5110e18, rel=1e-4)
    assert f / (32 * 1024) == pytest.approx(138e12, rel=0.005)


def test_megascale_scaling_ratio_by_hand():
    # 40.0 s x 256 / (11.9 s x 1024) = 10240 / 12185.6; 29.02 x 3072 / (8.57 x 12288): the "84%" and "85%"
    assert rows.per_gpu_scaling(40.0, 256, 11.9, 1024) == pytest.approx(0.84033, abs=1e-5)
    assert rows.per_gpu_scaling(29.02, 3072, 8.57, 12288) == pytest.approx(0.84656, abs=1e-5)
    assert rows.per_gpu_scaling(10.0, 8, 5.0, 16) == 1.0


def test_stack_options_mapping():
    assert rows.evaluator_options("megatron-2021") == dict(fused_attention=False,
                                                            overlap=Overlap.preset("megatron-2021"))
    assert rows.evaluator_options(rows.Stack.DEEPSPEED) == dict(fused_attention=False, overlap=Overlap.preset("deepspeed"),
                                                                zero3_live_parameters=1e9)
    bloom = rows.evaluator_options("megatron-deepspeed")["overlap"]   # after the flush, in fp32, gathers in the step
    assert (bloom.grad_reduce, bloom.param_gather, bloom.grad_reduce_dtype) == (False, False, "fp32")
    megascale = rows.evaluator_options("megatron")
    assert megascale["fused_attention"] is True and megascale["overlap"].tp_comm == 0.0
    # MegaScale section 3.3's overlaps are its own: the baseline hides no communication
    assert not (megascale["overlap"].grad_reduce or megascale["overlap"].param_gather or megascale["overlap"].p2p)
    assert megascale["overlap"].grad_reduce_dtype == "fp32"
    with pytest.raises(ValueError, match="torchtitan"):
        rows.evaluator_options("torchtitan")
    graph = planner.capture(gpt.build("tiny"), gpt.example_inputs(1, preset="tiny"))
    cluster = planner.Cluster.preset("dgx-a100-80gb")
    for stack in rows.Stack:   # every stack's options are Evaluator options
        options = rows.evaluator_options(stack)
        ev = Evaluator(graph, cluster, **options)
        assert (ev.fused_attention, ev.overlap) == (options["fused_attention"], options["overlap"])
    used = {r.stack for r in rows.RUNS}
    assert used == set(rows.Stack)


def test_searched_rows_keep_to_what_their_stack_could_run():
    # no sequence parallelism before Megatron-LM v3, no context parallelism before Megatron-Core 2024
    for stack in rows.Stack:
        assert rows.stack_constraints(stack)["context"] == 1
    assert "sequence_parallel" not in rows.stack_constraints("megatron")
    assert rows.stack_constraints("fsdp")["sequence_parallel"] is False
    from planner.search import FIXED_KNOBS
    assert all(k in FIXED_KNOBS for stack in rows.Stack for k in rows.stack_constraints(stack))


def test_jean_zay_cluster_has_its_omni_path_network():
    dgx = rows.cluster_for("dgx-a100-80gb", 384)
    jz = rows.cluster_for(rows.ClusterName.JEAN_ZAY, 384)
    assert jz.num_devices == dgx.num_devices == 384
    assert jz.inter_node.bandwidth == 4 * 100e9 / 8 / 8 == 6.25e9   # 4 x 100 Gb/s per node, 8 GPUs
    assert (jz.device, jz.intra_node) == (dgx.device, dgx.intra_node)


@pytest.fixture(scope="module")
def tiny4():
    with torch.device("meta"):
        model = gpt.build("tiny", num_layers=4)
    return planner.capture(model, gpt.example_inputs(1, device="meta", preset="tiny"))


def test_stage_boundaries_as_the_stacks_cut(tiny4):
    assert bench.stage_boundaries(tiny4, 2, rows.Partition.MEGATRON) == ("blocks.2",)
    # (4 blocks + embedding + head) / 3 stages: embedding + block 0 | blocks 1-2 | block 3 + head
    assert bench.stage_boundaries(tiny4, 3, rows.Partition.EMBEDDING_AS_BLOCK) == ("blocks.1", "blocks.3")
    assert bench.stage_boundaries(tiny4, 3, rows.Partition.PLANNER) is None
    with pytest.raises(ValueError, match="3 equal stages"):
        bench.stage_boundaries(tiny4, 3, rows.Partition.MEGATRON)


def test_error_is_a_throughput_error_for_both_units():
    run = next(r for r in rows.RUNS if r.name == "Megatron-LM GPT-3 example")
    cfg = planner.ParallelConfig(**dict(run.knobs))
    r = bench.Result(run, cfg, "published", step_time=25.0, tflops=170.0, fits=True, peak_gib=1.0, seconds=0.0)
    assert r.predicted == 25.0 and r.error == pytest.approx(32 / 25 - 1)   # predicted faster: +28%
    table2 = rows.RUNS[0]
    r = bench.Result(table2, cfg, "published", step_time=1.0, tflops=108.0, fits=True, peak_gib=1.0, seconds=0.0)
    assert r.predicted == 108.0 and r.error == pytest.approx(108 / 144 - 1)
