"""What tensor parallelism costs besides its all-reduces: measured through the runtime's own
modules (calibration.stage.time_strategy_extras), fitted per call and per element, and charged
by the planner (wrappers, the vocabulary-parallel embedding) and the simulator (the
vocabulary-parallel loss)."""

import dataclasses
from types import SimpleNamespace

import pytest

from codegen.emit import capture_ref
from cost_models.calibration.calibrate import build_cluster
from cost_models.calibration.stage import time_strategy_extras
from cost_models.calibrated import tensor_embedding_costs, tensor_wrapper_costs, vocab_loss_costs
from cost_models.comm import collective_time
from cost_models.hardware import Cluster
from cost_models.simulate import ComputeCosts
from planner.app.build_costs import loss_elements, vocab_split
from tests.unit.test_calibrate import _results
from tests.unit.test_calibrate_stage import _prediction, _stage_results

GPT_TINY = ("examples/models/gpt.py:build", {"preset": "tiny"})


def test_the_extras_are_measured_at_two_sizes_through_the_runtime_modules():
    got = time_strategy_extras(quick=True)["tensor_parallel"]
    assert set(got) == {"wrapper", "vocab_embedding", "vocab_loss"}
    for part, points in got.items():
        assert len(points) == 2 and points[0][0] < points[1][0], part
        assert all(0.0 <= t < 5e-3 for _, f, b in points for t in (f, b)), part
    # which variant costs more is the machine's to say: on a loaded one a difference of two
    # medians can come out as 0, and the fit then charges nothing rather than a negative time


def _with_tp_points(scale=1.0):
    results = _results()
    for r in results:
        r["stage"] = dict(_stage_results(), tensor_parallel={
            "wrapper": [[192, 2e-5 * scale, 1e-5], [24768, 4e-5 * scale, 1e-5]],
            "vocab_embedding": [[192, 3e-5, 2e-5], [24768, 5e-5, 2e-5]],
            "vocab_loss": [[32, 8e-5, 6e-5], [65568, 2e-4, 6e-5]]})
    return results


def test_the_fits_round_trip_per_call_and_per_element_over_the_cpu_share(tmp_path):
    cl = build_cluster(_with_tp_points())
    cl.save(tmp_path / "c.yaml")
    back = Cluster.load(tmp_path / "c.yaml")
    # a line through the two points, divided by the CPU share (0.5)
    assert tensor_wrapper_costs(back, 192) == pytest.approx((4e-5, 2e-5))
    assert tensor_wrapper_costs(back, 24768) == pytest.approx((8e-5, 2e-5))
    assert tensor_embedding_costs(back, 24768) == pytest.approx((1e-4, 4e-5))
    assert vocab_loss_costs(back, 65568) == pytest.approx((4e-4, 1.2e-4))
    assert vocab_loss_costs(back, 0) == (0.0, 0.0)
    m = dict(back.measurements)
    assert m["raw.tensor_parallel.vocab_loss.32.forward"] == pytest.approx(8e-5)
    # a cluster calibrated before these were measured charges nothing for them
    old = build_cluster(_results())
    assert tensor_embedding_costs(old, 1e4) == (0.0, 0.0) and vocab_loss_costs(old, 1e4) == (0.0, 0.0)


def test_the_simulator_charges_the_vocabulary_parallel_loss_and_its_three_all_reduces():
    cl = build_cluster(_with_tp_points())
    plain = ComputeCosts.from_prediction(_prediction(), cl, loss_elements=32768)
    split = ComputeCosts.from_prediction(_prediction(), cl, loss_elements=32768, vocab_split=(128, 2))
    vf, vb = vocab_loss_costs(cl, 32768)
    reduce = collective_time(cl, "all_reduce", 4 * 128, [0, 1]).seconds
    assert split.forward[1] - plain.forward[1] == pytest.approx(vf + 3 * reduce)
    assert split.backward[1] - plain.backward[1] == pytest.approx(vb)
    assert split.forward[0] == plain.forward[0]  # only the last stage computes the loss
    same = ComputeCosts.from_prediction(_prediction(), cl, loss_elements=32768, vocab_split=(128, 1))
    assert same == plain


def _plan(tensor, lm_head_role):
    return SimpleNamespace(config=SimpleNamespace(tensor=tensor), split_ranks=tensor,   # Plan.split_ranks
                           shardings=(("lm_head", lm_head_role),) if lm_head_role else ())


def test_a_class_split_output_splits_the_loss_over_the_tensor_ranks():
    graph = capture_ref(*GPT_TINY, batch_size=2)
    logits = next(n for n in graph.nodes if n.kind == "output").input_meta[0]
    rows = logits.numel / logits.shape[-1]
    # the planner marks the vocabulary projection "column_out"
    assert loss_elements(graph, _plan(2, "column_out")) == logits.numel / 2
    assert vocab_split(graph, _plan(2, "column_out")) == (rows, 2)
    assert loss_elements(graph, _plan(2, None)) == logits.numel
    assert vocab_split(graph, _plan(2, None)) is None and vocab_split(graph, _plan(1, "column_out")) is None


def test_the_planner_charges_the_vocabulary_parallel_embedding_not_a_wrapper():
    import planner
    from planner.evaluator import Evaluator

    graph = capture_ref(*GPT_TINY, batch_size=4)
    base = build_cluster(_results())
    fits = {"fit.tensor_embedding.forward": 3e-5, "fit.tensor_embedding.forward_per_element": 1e-9,
            "fit.tensor_embedding.backward": 2e-5, "fit.tensor_wrapper.forward": 7e-5}
    extra = dataclasses.replace(base, measurements=tuple(sorted(dict(base.measurements, **fits).items())))
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", tensor=2)
    ev, ev_x = Evaluator(graph, base, sharding="all"), Evaluator(graph, extra, sharding="all")
    vocab = [n for n in graph.nodes if ev.sharding.roles.get(n.name) and ev.sharding.roles[n.name].role == "vocab"]
    assert vocab
    for n in vocab:
        a, b = ev.node_cost(n, "vocab", cfg), ev_x.node_cost(n, "vocab", cfg)
        elements = ev.sharding.roles[n.name].fwd_allreduce / 2 / 4  # a micro-batch of 2 of the 4 captured
        assert b.on("tensor").forward - a.on("tensor").forward == pytest.approx(3e-5 + 1e-9 * elements)
        assert b.on("tensor").backward - a.on("tensor").backward == pytest.approx(2e-5)
