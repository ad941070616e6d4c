"""Spatial parallelism in the plan: config fields and their JSON round trip, the halo / gather cost
formulas (hand-computed), and what the Evaluator predicts for a spatially split CNN."""

from __future__ import annotations

import pytest
import torch

import planner
from planner.evaluator import Evaluator
from planner.strategies.spatial.costs import batchnorm_sync_bytes, halo_seconds, memory_saved_per_device, window_halo_bytes
from examples.models import large_image_cnn
from planner import ParallelConfig, Plan
from planner.config import ConfigError
from planner.plan import PlanFileError
from planner.strategies.spatial.strategy import MIN_TILE_ROWS, SpatialPricer, spatial_candidates
from runtime.vocab import MeshAxis


# ---- config ---------------------------------------------------------------

def test_spatial_fields_validate_and_count_devices():
    c = ParallelConfig(data=2, spatial=4, spatial_split="grid", spatial_until="features.3")
    assert c.num_devices == 8
    assert c.mesh == {MeshAxis.PIPELINE: 1, "data": 2, "spatial": 4, "tensor": 1}
    assert "s4 grid..features.3" in c.short()
    assert ParallelConfig().mesh == {MeshAxis.PIPELINE: 1, "data": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="needs spatial_until"):
        ParallelConfig(spatial=2)
    with pytest.raises(ConfigError, match="needs spatial >= 2"):
        ParallelConfig(spatial_until="features.0")
    with pytest.raises(ConfigError, match="spatial_split='diagonal' is not one of strips_h, strips_v, grid"):
        ParallelConfig(spatial=2, spatial_split="diagonal", spatial_until="x")
    with pytest.raises(ConfigError, match="spatial_batchnorm"):
        ParallelConfig(spatial=2, spatial_until="x", spatial_batchnorm="global")
    with pytest.raises(ConfigError, match="spatial must be a positive integer"):
        ParallelConfig(spatial=0)


def test_spatial_config_json_round_trip():
    c = ParallelConfig(spatial=2, spatial_split="strips_v", spatial_until="features.2", spatial_batchnorm="local")
    assert ParallelConfig.from_dict(c.to_dict()) == c


@pytest.fixture(scope="module")
def cnn():
    kw = dict(image_size=1024, layers=((16, 3, 1), (16, 3, 1), (16, 5, 2), (16, 1, 1)))
    model = large_image_cnn.build(**kw)
    return planner.capture(model, large_image_cnn.example_inputs(2, "meta", **kw))


def _cluster(n):
    return planner.Cluster.preset("dgx-a100-80gb", nodes=1) if n == 8 else \
        planner.Cluster.preset("local", devices=n)


def test_spatial_plan_json_round_trip_and_damage(cnn):
    cfg = ParallelConfig(spatial=4, spatial_split="grid", spatial_until="features.3", dtype="fp32")
    plan = planner.make_plan(cnn, planner.Cluster.preset("local", devices=4), cfg, global_batch_size=2)
    again = Plan.from_dict(plan.to_dict())
    assert again.config == cfg and again.prediction == plan.prediction
    assert "spatial: 4 tiles (grid) per image through layer features.3" in plan.summary()
    doc = plan.to_dict()
    doc["config"]["spatial_until"] = "no.such.layer"
    with pytest.raises(PlanFileError, match="spatial_until"):
        Plan.from_dict(doc)
    doc["config"]["spatial_until"] = 7
    with pytest.raises(PlanFileError, match="spatial_until.*must be a string"):
        Plan.from_dict(doc)


# ---- formulas -------------------------------------------------------------

def test_halo_bytes_for_strips_and_grid_hand_computed():
    # 3x3 stride 1 pad 1 on (1, 16, 1024, 1024) in bf16 over 4 horizontal strips: 1 row x 1024 x 16 x 2 B
    h = window_halo_bytes((1, 16, 1024, 1024), 3, 1, 1, 1, "strips_h", 4, 2)
    assert (h.rows_phase, h.cols_phase) == (32768, 0)
    assert h.per_step_exchange == 65536
    assert h.compute_factor == pytest.approx(258 / 256)
    # 2x2 grid: tiles 512 x 512; rows phase 512 x 16 x 2; columns phase (512 + 2) rows x 16 x 2 (corners)
    g = window_halo_bytes((1, 16, 1024, 1024), (3, 3), (1, 1), (1, 1), (1, 1), "grid", 4, 2)
    assert (g.rows_phase, g.cols_phase) == (16384, 16448)
    # 5x5: two rows; 1x1: none
    assert window_halo_bytes((1, 1, 64, 64), 5, 1, 1, 2, "strips_v", 2, 4).cols_phase == 2 * 64 * 4
    assert window_halo_bytes((1, 1, 64, 64), 1, 1, 1, 0, "grid", 4, 4).per_step_exchange == 0


def test_halo_seconds_one_p2p_per_phase():
    g = window_halo_bytes((1, 16, 1024, 1024), 3, 1, 1, 1, "grid", 4, 2)
    p2p = lambda n: 1e-5 + n / 1e9  # noqa: E731
    assert halo_seconds(g, p2p) == pytest.approx(2e-5 + (16384 + 16448) / 1e9)


def test_memory_saved_and_batchnorm_payloads():
    assert memory_saved_per_device(8 * 2**30, 4) == 6 * 2**30
    assert batchnorm_sync_bytes(16) == (33 * 4, 33 * 4)


# ---- evaluator ------------------------------------------------------------

def test_spatial_layers_cost_a_quarter_plus_halos_and_the_gather(cnn):
    cl = planner.Cluster.preset("local", devices=4)
    ev = Evaluator(cnn, cl)
    base = ParallelConfig(data=1, pipeline=1, tensor=1, dtype="fp32")
    whole = [ev.layer_cost(layer, base) for layer in cnn.layers]  # (layer costs do not check the device count)
    cfg = ParallelConfig(spatial=4, spatial_split="grid", spatial_until="features.3", dtype="fp32")
    tiled = [ev.layer_cost(layer, cfg) for layer in cnn.layers]
    k = [layer.name for layer in cnn.layers].index("features.3")
    for w, t in zip(whole[:k + 1], tiled[:k + 1]):
        assert t.saved == pytest.approx(w.saved / 4)
        assert w.forward / 4 <= t.forward <= w.forward / 4 * (516 / 512) ** 2 * (1 + 1e-9)  # 5x5 halo area
    assert tiled[1].on("spatial").forward > 0                                # a 3x3 conv exchanges halos
    assert tiled[k].boundary == whole[k].boundary                 # gathered: the full activation
    assert tiled[k].on("spatial").forward > tiled[1].on("spatial").forward              # the gather is charged on it
    for w, t in zip(whole[k + 1:], tiled[k + 1:]):
        assert t == w                                             # replicated after the gather
    p_whole = ev.evaluate(base.replace(data=2, pipeline=2), 2)
    p_tiled = ev.evaluate(cfg, 2)
    assert p_tiled.memory.activations < p_whole.memory.activations / 2
    assert p_tiled.time.data_comm > 0                              # tile weight gradients summed


def test_spatial_until_a_layer_that_cannot_be_tiled_is_refused_naming_it(cnn):
    ev = Evaluator(cnn, planner.Cluster.preset("local", devices=2))
    with pytest.raises(ConfigError, match="layer 'avgpool'.*does not run on image tiles.*'pool'"):
        ev.evaluate(ParallelConfig(spatial=2, spatial_until="fc", dtype="fp32"), 2)
    with pytest.raises(ConfigError, match="not a layer of this model"):
        ev.evaluate(ParallelConfig(spatial=2, spatial_until="nope", dtype="fp32"), 2)


def test_candidates_end_each_resolution_and_keep_tiles_thick(cnn):
    pricer = SpatialPricer(cnn)
    cands = spatial_candidates(pricer, 4)
    assert ("grid", "features.1") in cands and ("strips_h", "pool") in cands
    assert all(until != "features.0" for _, until in cands)   # same resolution as features.1
    # 1024 / 2 / 2 (pool) = 256 rows: 64 strips of 4 rows are thinner than MIN_TILE_ROWS at the pool
    assert ("strips_h", "pool") not in spatial_candidates(pricer, 64) and MIN_TILE_ROWS > 4


def test_pipelined_spatial_configs_keep_the_spatial_part_in_the_first_stage(cnn):
    from planner.stage_split import balanced_partition
    from planner.strategies.spatial.strategy import first_stage_partition

    # time-balanced cuts would split after layer 1; the spatial part (layers 0..2) stays whole
    assert balanced_partition([1, 1, 1, 1, 1, 1], 2) == [(0, 3), (3, 6)]
    assert first_stage_partition(2, [4, 4, 4, 1, 1, 1], 2, None, balanced_partition) == [(0, 3), (3, 6)]
    assert first_stage_partition(0, [1, 5, 5], 2, None, balanced_partition) == [(0, 2), (2, 3)]
    with pytest.raises(ConfigError, match="only 1 layers remain"):
        first_stage_partition(4, [1] * 6, 3, None, balanced_partition)
    ev = Evaluator(cnn, planner.Cluster.preset("local", devices=4))
    cfg = ParallelConfig(pipeline=2, spatial=2, spatial_until="features.2", dtype="fp32")
    pred = ev.evaluate(cfg, 2)
    assert pred.stages[0].last_layer in ("features.2", "features.3", "pool")
    bidi = ev.evaluate(cfg.replace(pipeline=2, bidirectional=True), 2)   # GEMS bounds keep it too
    assert bidi.stages[0].last_layer in ("features.2", "features.3", "pool")


def test_graphs_without_convolutions_get_no_spatial_candidates():
    from examples.models import gpt

    with torch.device("meta"):
        model = gpt.build(preset="tiny")
    g = planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset="tiny"))
    pricer = SpatialPricer(g)
    assert not pricer.has_convs and spatial_candidates(pricer, 8) == []


def test_plan_pictures_of_a_spatial_plan(cnn):
    import importlib

    import matplotlib

    matplotlib.use("Agg")
    from planner.app.schedule_view import rank_coords

    visualize = importlib.import_module("planner.app.visualize")
    cfg = ParallelConfig(data=2, pipeline=2, spatial=2, spatial_until="features.2", dtype="fp32")
    plan = planner.make_plan(cnn, planner.Cluster.preset("local", devices=8), cfg, global_batch_size=4)
    # rank 5 = pipe 1, data 0, spatial 1: the spatial coordinate folds into the data coordinate
    assert rank_coords(5, plan.mesh) == (1, 1, 0)
    for fig in (visualize.mesh_figure(plan), visualize.memory_figure(plan), visualize.schedule_figure(plan)):
        assert fig.axes


def test_wide_images_are_cut_into_vertical_strips():
    model = large_image_cnn.build(image_size=256, layers=((8, 3, 1),))
    g = planner.capture(model, (torch.empty(1, 3, 256, 2048, device="meta"),))
    cands = spatial_candidates(SpatialPricer(g), 4)
    assert {split for split, _ in cands} == {"strips_v", "grid"}
