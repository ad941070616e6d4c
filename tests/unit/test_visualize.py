"""Plan pictures and the HTML report: files written and readable, layouts without overlapping
text, the simulated pipeline schedules, and bad input refused with a clear ValueError."""

import dataclasses
import math
import re
import subprocess
import sys

import matplotlib.image
import pytest
import torch

import planner
from cost_models.mesh_axes import axis_groups
from examples.models import gpt
from planner.app.report import report_path, write_report
from planner.app.visualize import (FIGURES, ScheduleRecord, figures, layout_problems, load_timeline,
                               memory_figure, time_figure,
                               predicted_schedule, rank_coords, save_figure, save_timeline, schedule_figure,
                               schedule_orders, simulate_schedule, style, visualize)
from runtime.vocab import MeshAxis


def _graph(preset):
    with torch.device("meta"):
        model = gpt.build(preset=preset)
    return planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset=preset))


def _cluster(nodes):
    return planner.Cluster.preset("dgx-a100-80gb", nodes=nodes)


@pytest.fixture(scope="module")
def small():
    return _graph("small")


@pytest.fixture(scope="module")
def plan(small):
    """2 nodes, chosen by the search (so it carries alternatives)."""
    return planner.optimize(small, _cluster(2), global_batch_size=64, progress=False, constraints={"pipeline": 4})


@pytest.fixture(scope="module")
def big(small):
    """512 devices: the mesh falls back to one data-parallel replica."""
    cfg = planner.ParallelConfig(data=64, tensor=2, pipeline=4, micro_batch_size=1)
    return planner.make_plan(small, _cluster(64), cfg, global_batch_size=512)


def _uniform(plan):
    """The plan with every stage as fast as stage 0 (so the schedule formulas are exact)."""
    st = plan.prediction.stages[0]
    stages = tuple(dataclasses.replace(s, forward=st.forward, backward=st.backward) for s in plan.prediction.stages)
    return dataclasses.replace(plan, prediction=dataclasses.replace(plan.prediction, stages=stages)), st


# ---- files ---------------------------------------------------------------------------------


def test_pictures_are_written_and_readable(plan, tmp_path):
    files = visualize(plan, tmp_path / "gpt")
    assert [f.name for f in files] == [f"gpt_{k}.{ext}" for k in FIGURES for ext in ("png", "svg")]
    for f in files:
        assert f.parent == tmp_path and f.stat().st_size > 1000
        if f.suffix == ".png":
            img = matplotlib.image.imread(f)
            assert img.shape[0] > 300 and img.shape[1] > 900, (f.name, img.shape)
        else:
            kind = f.stem.split("_", 1)[1]
            title = {"mesh": "Device mesh", "memory": "Memory per device", "time": "Time per step",
                     "alternatives": "Alternatives", "schedule": "Pipeline schedule"}[kind]
            text = f.read_text()
            assert f"{title}: GPT on dgx-a100-80gb (2 nodes x 8 = 16 devices)" in text, f.name
            assert plan.config.short() in text


def test_one_node_plan_into_a_new_directory(small, tmp_path):
    one = planner.optimize(small, _cluster(1), global_batch_size=32, progress=False)
    out = tmp_path / "a" / "b"
    files = visualize(one, f"{out}/", formats=("png",))
    assert [f.name for f in files] == [f"{k}.png" for k in FIGURES]
    assert all(f.parent == out and f.stat().st_size > 1000 for f in files)


def test_large_cluster_draws_one_replica(big, tmp_path):
    with style():
        figs = figures(big)
        for name, fig in figs.items():
            assert layout_problems(fig) == [], name
        save_figure(figs["mesh"], tmp_path / "mesh.svg", "svg")
    assert "x 64 data replicas" in (tmp_path / "mesh.svg").read_text()
    cells = [t.get_text() for t in figs["mesh"].axes[0].texts if re.match(r"r\d+\n", t.get_text())]
    # pipe 4 x tensor 2 devices of data coordinate 0, each with its (p,d,t)
    assert sorted(cells) == sorted(f"r{p * 128 + t}\n({p},0,{t})" for p in range(4) for t in range(2))


def test_no_overlapping_or_clipped_text(plan):
    measured = [ScheduleRecord(r.rank, r.label, r.kind, 2 * r.start, 2 * r.end) for r in predicted_schedule(plan)]
    measured += [ScheduleRecord(0, "ALLREDUCE grads", "collective", 0.0, 1e-3)]  # overlaps rank 0's work
    with style():
        figs = figures(plan)
        figs["schedule with measured"] = schedule_figure(plan, measured=measured)
        for name, fig in figs.items():
            assert layout_problems(fig) == [], name
            for ax in fig.axes:  # every drawn axis says what it shows
                if ax.xaxis.get_visible() and ax.get_xticks().size:
                    assert ax.get_xlabel(), name
            assert fig.legends or any(ax.get_legend() for ax in fig.axes), name  # colours are explained


def test_units_adapt_to_the_size(plan):
    with style():
        mem, tim = memory_figure(plan), time_figure(plan)
    peak = plan.prediction.peak_memory
    assert 2**20 <= peak < 2**30  # a few MiB: shown in MiB, not as 0.01 GiB
    assert mem.axes[0].get_ylabel() == "memory per device (MiB)"
    step = plan.prediction.step_time
    unit = "s" if step >= 1 else "ms" if step >= 1e-3 else "µs"
    assert tim.axes[0].get_xlabel() == f"time within one step ({unit})"
    assert unit != "s"


def test_html_report_is_self_contained(plan, tmp_path):
    out = write_report(plan, tmp_path / "sub" / "report.html")
    assert out == tmp_path / "sub" / "report.html"
    text = out.read_text()
    assert text.count("<svg") == 5 and "Summary" in text and "mesh:" in text and "chosen:" in text
    assert "Device mesh: GPT on dgx-a100-80gb" in text
    assert "src=\"http" not in text and "<script" not in text and "<link" not in text
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == len(set(ids))  # the five inline SVGs do not clash
    for ref in re.findall(r'url\(#([^)]+)\)', text):
        assert ref in ids
    assert report_path(f"{tmp_path}/new/") == tmp_path / "new" / "report.html"


def test_measured_beside_predicted_and_timeline_round_trip(plan, tmp_path):
    pred = predicted_schedule(plan)
    path = save_timeline(pred, tmp_path / "t.json")
    assert load_timeline(path) == pred
    measured = [{"rank": r.rank, "label": r.label, "kind": r.kind, "start": 10 + r.start * 1.5,
                 "end": 10 + r.end * 1.5} for r in pred]
    files = visualize(plan, tmp_path / "cmp", measured=measured, formats=("svg",))
    svg = next(f for f in files if f.name == "cmp_schedule.svg").read_text()
    assert "predicted vs measured" in svg and "measured:" in svg and "predicted:" in svg


def test_importing_does_no_work():
    code = "import sys, planner.app.visualize, planner.app.report; assert 'matplotlib' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- schedules -----------------------------------------------------------------------------


def test_mesh_coordinates_match_axis_groups():
    mesh = {MeshAxis.PIPELINE: 3, "data": 2, "tensor": 4}
    for k, axis in enumerate((MeshAxis.PIPELINE, "data", "tensor")):
        for group in axis_groups(mesh, axis):
            coords = [rank_coords(r, mesh) for r in group]
            assert [c[k] for c in coords] == list(range(mesh[axis]))
            assert len({c[:k] + c[k + 1:] for c in coords}) == 1


@pytest.mark.parametrize("cfg", [dict(data=2, context=2, tensor=2, pipeline=2), dict(data=2, context=4),
                                 dict(data=2, spatial=2, spatial_until="x", tensor=2)],
                         ids=["context_t2_p2", "context4", "spatial_t2"])
def test_mesh_coordinates_fold_the_axes_between_pipeline_and_tensor_into_data(cfg):
    """A rank's (pipe, data, tensor) coordinates over every rank of meshes with a context or spatial axis
    (once, the mesh picture failed for context plans: the context axis was left out of the data
    coordinate, so ranks fell on pipeline positions that do not exist)."""
    mesh = planner.ParallelConfig(**cfg).mesh
    world, pipe, tensor = math.prod(mesh.values()), mesh[MeshAxis.PIPELINE], mesh[MeshAxis.TENSOR]
    coords = [rank_coords(r, mesh) for r in range(world)]
    assert len(set(coords)) == world
    assert {c[0] for c in coords} == set(range(pipe)) and {c[2] for c in coords} == set(range(tensor))
    assert {c[1] for c in coords} == set(range(world // (pipe * tensor)))
    for group in axis_groups(mesh, MeshAxis.TENSOR):
        assert [rank_coords(r, mesh)[2] for r in group] == list(range(tensor))


def test_the_mesh_picture_of_a_context_plan(small, tmp_path):
    cfg = planner.ParallelConfig(data=2, context=2, tensor=2, micro_batch_size=1)
    plan = planner.make_plan(small, _cluster(1), cfg, global_batch_size=8)
    written = visualize(plan, tmp_path / "ctx", formats=("png",))
    assert written and all(p.is_file() for p in written)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1)])
def test_predicted_makespan_with_uniform_stages(small, schedule, virtual):
    cfg = planner.ParallelConfig(data=4, pipeline=4, micro_batch_size=2, schedule=schedule)
    plan, st = _uniform(planner.make_plan(small, _cluster(2), cfg, global_batch_size=64))
    assert plan.prediction.num_micro_batches == 8
    recs = predicted_schedule(plan, max_micro_batches=8)
    m, p = 8, 4
    per_rank = {}
    for r in recs:
        per_rank.setdefault(r.rank, []).append(r)
    assert sorted(per_rank) == [0, 4, 8, 12]  # the pipeline of data 0, tensor 0
    for rank, rs in per_rank.items():
        assert sum(r.kind == "forward" for r in rs) == m and sum(r.kind == "backward" for r in rs) == m
        rs.sort(key=lambda r: r.start)
        assert all(a.end <= b.start + 1e-15 for a, b in zip(rs, rs[1:]))  # one thing at a time
    makespan = max(r.end for r in recs) - min(r.start for r in recs)
    assert makespan == pytest.approx((m + p - 1) * (st.forward + st.backward))
    fewer = predicted_schedule(plan, max_micro_batches=3)
    assert sum(r.rank == 0 for r in fewer) == 6


def test_predicted_interleaved(small):
    cfg = planner.ParallelConfig(data=2, pipeline=4, micro_batch_size=1, schedule="interleaved", virtual_stages=2)
    plan, st = _uniform(planner.make_plan(small, _cluster(1), cfg, global_batch_size=16))
    recs = predicted_schedule(plan, max_micro_batches=8, ranks=range(8))
    assert {r.rank for r in recs} == set(range(8))
    for rank in range(8):
        mine = [r for r in recs if r.rank == rank]
        assert len(mine) == 2 * 8 * 2
        pipe = rank_coords(rank, cfg.mesh)[0]
        assert {int(r.label.split()[1][1:]) for r in mine} == {pipe, pipe + 4}  # its two chunks
    makespan = max(r.end for r in recs)
    assert makespan == pytest.approx((8 * 2 + 4 - 1) * (st.forward + st.backward))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_schedules_respect_dependencies_and_never_deadlock(schedule):
    for p in range(1, 7):
        for v in ((2, 3) if schedule == "interleaved" else (1,)):
            for m in range(1, 13):
                s = p * v
                fwd = [1.0 + 0.1 * k for k in range(s)]
                bwd = [2.0 + 0.3 * (k % 3) for k in range(s)]
                ops = simulate_schedule(schedule_orders(schedule, p, m, v), fwd, bwd)
                assert len(ops) == 2 * m * s
                end = {(op, st, j): e for _, op, st, j, _, e in ops}
                for i, op, st, j, start, e in ops:
                    assert st % p == i
                    if op == "F" and st:
                        assert start >= end[("F", st - 1, j)]
                    if op == "B":
                        assert start >= end[("F", st, j)]
                        if st < s - 1:
                            assert start >= end[("B", st + 1, j)]


# ---- bad input ------------------------------------------------------------------------------


def test_bad_input(plan, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot create directory"):
        visualize(plan, blocker / "deeper" / "gpt")
    with pytest.raises(ValueError, match="end 1.0 s is before start 2.0 s"):
        ScheduleRecord(0, "F s0 m0", "forward", 2.0, 1.0)
    with pytest.raises(ValueError, match=r"timeline record 1: .*'B s0 m0'.* end .* before start"):
        visualize(plan, tmp_path / "x", timeline=[(0, "F s0 m0", "forward", 0.0, 1.0),
                                                   {"rank": 0, "label": "B s0 m0", "kind": "backward",
                                                    "start": 2.0, "end": 1.5}])
    with pytest.raises(ValueError, match="kind 'fwd' is not one of"):
        visualize(plan, tmp_path / "x", measured=[(0, "F", "fwd", 0.0, 1.0)])
    with pytest.raises(ValueError, match="no records"):
        visualize(plan, tmp_path / "x", timeline=[])
    with pytest.raises(ValueError, match="expected a planner.Plan"):
        visualize("plan.json", tmp_path)
    with pytest.raises(ValueError, match="formats"):
        visualize(plan, tmp_path, formats=("jpg",))
    with pytest.raises(ValueError, match=r"must end in \.html"):
        write_report(plan, tmp_path / "report.txt")
    with pytest.raises(ValueError, match="cannot create directory"):
        write_report(plan, blocker / "report.html")
    assert not (tmp_path / "x_mesh.png").exists()  # nothing written before the input was checked
