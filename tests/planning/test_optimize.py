"""planner.optimize on meta-captured models: optimality, constraints, errors, the golden plan."""

import dataclasses
import io
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

import planner
from planner.evaluator import Evaluator
from cost_models.hardware import Cluster
from examples.models import gpt, mlp
from planner import NoFeasiblePlan, ParallelConfig, Plan
from planner.config import ConfigError
from planner.progress import Progress
from runtime.execution import Execution

GOLDEN = Path(__file__).parent / "golden" / "gpt_small_2xdgx.json"


def _graph(mod=gpt, batch=1, **kw):
    with torch.device("meta"):
        model = mod.build(**kw)
    return planner.capture(model, mod.example_inputs(batch_size=batch, device="meta", **kw))


@pytest.fixture(scope="module")
def small():
    return _graph(preset="small")


def _small_gpus(n: int, memory_gib: float) -> Cluster:
    """n GPUs (2 per node) with little memory, so that memory binds."""
    base = Cluster.preset("dgx-a100-80gb")
    dev = dataclasses.replace(base.device, memory_bytes=int(memory_gib * 2**30))
    return dataclasses.replace(base, device=dev, num_nodes=n // 2, devices_per_node=2, name="small-gpus")


def _exhaustive(graph, cluster, batch):
    """Price every configuration (all schedules, recompute modes, ZeRO stages, micro-batches, sequence
    parallelism where the tensor degree allows it)."""
    ev = Evaluator(graph, cluster)
    n = cluster.num_devices
    best = None
    for t, p in itertools.product(range(1, n + 1), repeat=2):
        if n % (t * p):
            continue
        d = n // (t * p)
        for mb, sched, v, rc, z, dt, sp in itertools.product(range(1, batch + 1), ("gpipe", "1f1b", "interleaved"),
                                                             (1, 2, 4), ("none", "selective", "full"), (0, 1, 2, 3),
                                                             ("bf16",), (False, True)):
            if (sched == "interleaved") != (v > 1) or (z and d == 1) or t > cluster.devices_per_node or \
                    (sp and t == 1):
                continue
            try:
                cfg = ParallelConfig(data=d, tensor=t, pipeline=p, micro_batch_size=mb, schedule=sched,
                                     virtual_stages=v, recompute=rc, zero=z, dtype=dt, sequence_parallel=sp)
                pred = ev.evaluate(cfg, batch)
            except ConfigError:
                continue
            if pred.fits and (best is None or pred.step_time < best[1].step_time):
                best = (cfg, pred)
        for T, rc in itertools.product((1, 2, 4), ("none", "selective", "full")):  # GEMS bi-directional
            if p < 2 or batch % (d * 2 * T) or t > cluster.devices_per_node:
                continue
            cfg = ParallelConfig(data=d, tensor=t, pipeline=p, micro_batch_size=batch // (d * 2 * T),
                                 recompute=rc, bidirectional=True, replicas_per_direction=T)
            try:
                pred = ev.evaluate(cfg, batch)
            except ConfigError:
                continue
            if pred.fits and (best is None or pred.step_time < best[1].step_time):
                best = (cfg, pred)
    return best


@pytest.mark.parametrize("kind,memory_gib", [("gpt", 80), ("gpt", 0.44 / 1024), ("mlp", 80)])
def test_optimize_equals_exhaustive_search(kind, memory_gib):
    graph = _graph(preset="tiny") if kind == "gpt" else _graph(mlp, in_features=64, hidden=256, num_layers=4)
    cluster = _small_gpus(4, memory_gib)
    batch = 8
    best_cfg, best_pred = _exhaustive(graph, cluster, batch)
    # the configuration search at the default execution options, as the exhaustive loop prices them
    plan = planner.optimize(graph, cluster, global_batch_size=batch, progress=False, runtime=None,
                            execution=Execution())
    assert plan.prediction.step_time == pytest.approx(best_pred.step_time, rel=1e-12), (plan.config, best_cfg)
    assert plan.prediction.fits
    # left to choose them, it keeps that configuration and takes the execution options that pay for it
    chosen = planner.optimize(graph, cluster, global_batch_size=batch, progress=False, runtime=None)
    assert chosen.config == plan.config and chosen.prediction.fits
    assert chosen.prediction.step_time <= plan.prediction.step_time
    if memory_gib < 1:  # memory binds: the unconstrained optimum would not fit here
        roomy = planner.optimize(graph, _small_gpus(4, 80), global_batch_size=batch, progress=False)
        assert roomy.prediction.peak_memory > cluster.device.memory_bytes
        assert plan.prediction.step_time > roomy.prediction.step_time


def test_plan_round_trip_summary_and_explain(small, tmp_path):
    plan = planner.optimize(small, Cluster.preset("dgx-a100-80gb", nodes=2), global_batch_size=64, progress=False)
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back == plan
    assert back.graph_fingerprint == small.fingerprint
    text = plan.summary()
    assert "mesh:" in text and "time per step" in text and "memory per device" in text
    names = [name for s in plan.stages for name in s.layers]
    assert names == [layer.name for layer in small.layers]  # every layer exactly once, in order
    why = planner.explain(plan)
    assert "chosen:" in why and "lost on" in why
    assert all(a.step_time >= plan.prediction.step_time or not a.fits for a in plan.alternatives)
    search = dict(plan.search)
    assert search["evaluated"] > 0 and search["candidates"] >= search["pruned"]


def test_golden_plan_small_gpt_on_two_dgx_nodes(small):
    """Update deliberately: MESHPLAN_UPDATE_GOLDEN=1 python -m pytest tests/planning -k golden."""
    plan = planner.optimize(small, Cluster.preset("dgx-a100-80gb", nodes=2), global_batch_size=64, progress=False)
    got = {"config": plan.config.to_dict(), "stages": [list(s.layers) for s in plan.stages],
           "shardings": dict(plan.shardings), "step_time": plan.prediction.step_time}
    if os.environ.get("MESHPLAN_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert got["config"] == want["config"]
    assert got["stages"] == want["stages"]
    assert got["shardings"] == want["shardings"]
    assert got["step_time"] == pytest.approx(want["step_time"], rel=1e-6)


def test_constraints_are_honoured(small):
    cl = Cluster.preset("dgx-a100-80gb", nodes=2)
    plan = planner.optimize(small, cl, global_batch_size=64, progress=False,
                            constraints={"tensor": 2, "schedule": "1f1b", "recompute": "full"})
    c = plan.config
    assert (c.tensor, c.schedule, c.recompute) == (2, "1f1b", "full")
    free = planner.optimize(small, cl, global_batch_size=64, progress=False)
    assert free.prediction.step_time <= plan.prediction.step_time
    capped = planner.optimize(small, cl, global_batch_size=64, progress=False,
                              constraints={"max_memory_fraction": 0.5})
    assert capped.prediction.peak_memory <= 0.5 * capped.prediction.memory_capacity


def test_energy_objective(small):
    cl = Cluster.preset("dgx-a100-80gb", nodes=2)
    by_time = planner.optimize(small, cl, global_batch_size=64, progress=False)
    by_energy = planner.optimize(small, cl, global_batch_size=64, progress=False, objective="energy")
    assert by_energy.prediction.step_energy <= by_time.prediction.step_energy
    cap = by_time.prediction.step_energy * 1.5
    capped = planner.optimize(small, cl, global_batch_size=64, progress=False,
                              constraints={"max_step_energy_j": cap})
    assert capped.prediction.step_energy <= cap


def test_no_feasible_plan_says_what_would_help():
    graph = _graph(preset="small")
    with pytest.raises(NoFeasiblePlan) as info:
        planner.optimize(graph, _small_gpus(2, 0.0005), global_batch_size=8, progress=False)
    msg = str(info.value)
    assert "needs" in msg and "GiB per device" in msg and "What would help" in msg and "more devices" in msg


@pytest.mark.parametrize("kwargs,needle", [
    (dict(objective="speed"), "objective='speed'"),
    (dict(constraints={"tensr": 2}), "did you mean 'tensor'"),
    (dict(constraints={"max_memory_fraction": 1.5}), "max_memory_fraction"),
])
def test_bad_arguments(small, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        planner.optimize(small, Cluster.preset("dgx-a100-80gb"), global_batch_size=8, progress=False, **kwargs)


def test_no_mesh_shape_for_an_odd_batch(small):
    with pytest.raises(NoFeasiblePlan, match="no mesh shape"):
        planner.optimize(small, Cluster.preset("dgx-a100-80gb"), global_batch_size=7, progress=False,
                         constraints={"tensor": 1, "pipeline": 1})


def test_make_plan_uses_the_same_road(small):
    cl = Cluster.preset("dgx-a100-80gb", nodes=2)
    cfg = ParallelConfig(data=4, tensor=2, pipeline=2, micro_batch_size=2)
    plan = planner.make_plan(small, cl, cfg, global_batch_size=64)
    assert plan.config == cfg and len(plan.stages) == 2
    # priced as planner.evaluate prices it, at the execution options make_plan chose for it (on these GPUs,
    # those that pay: planner/execution_choice.py), which beat the defaults or are them
    assert plan.prediction == planner.evaluate(small, cl, cfg, global_batch_size=64, execution=plan.execution)
    default = planner.evaluate(small, cl, cfg, global_batch_size=64)
    assert plan.execution.is_default or plan.prediction.step_time < default.step_time
    assert "no alternatives recorded" in planner.explain(plan)


def test_progress_bar_only_when_asked():
    out = io.StringIO()
    bar = Progress(10, "search", enabled=True, stream=out, after=0.0)
    bar.update(5, "half")
    bar.close("done")
    assert "[###############...............] 5/10" in out.getvalue() and "done in" in out.getvalue()
    quiet = io.StringIO()
    bar = Progress(10, "search", enabled=None, stream=quiet, after=0.0)  # StringIO is not a terminal
    bar.update(5)
    bar.close()
    assert quiet.getvalue() == ""


def test_search_picks_the_fastest_dtype_the_device_and_runtime_have():
    """V100s (Summit) have fp16 but no bf16: the runtime trains fp16 with loss scaling, so the plan does;
    a runtime without fp16 keeps fp32; an A100 ties bf16 and fp16 and takes bf16 (no loss scaling)."""
    from examples.models import resnet
    from planner.capabilities import RuntimeSupport
    graph = _graph(resnet, batch=2, depth=20)
    summit = dataclasses.replace(Cluster.preset("summit"), num_nodes=2)
    assert planner.optimize(graph, summit, global_batch_size=64, progress=False).config.dtype == "fp16"
    no_fp16 = RuntimeSupport(dtypes=("fp32", "bf16"))
    assert planner.optimize(graph, summit, global_batch_size=64, progress=False,
                            runtime=no_fp16).config.dtype == "fp32"
    a100 = dataclasses.replace(Cluster.preset("dgx-a100-80gb"), num_nodes=1)
    assert a100.device.peak("bf16") == a100.device.peak("fp16")
    assert planner.optimize(graph, a100, global_batch_size=64, progress=False).config.dtype == "bf16"
