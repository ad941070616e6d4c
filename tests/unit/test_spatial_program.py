"""Spatial parallelism as the build states it: each rank's Program names its tile and spatial group
(runtime.program.SpatialTiles, JSON round trip, checked fields), and the first stage's generated
code calls the tile ops itself (codegen/strategies/spatial/tiles.py), so the runtime traces nothing."""

import dataclasses
import json

import pytest

import planner
from codegen.emit import capture_ref
from codegen.lower import lower_plan
from runtime.program import Instr, Program, ProgramError
from runtime.parallel.spatial.part import SpatialTiles
from runtime.parallel.spatial.tiles import SpatialContext
from runtime.parallel.spatial.geometry import SpatialError

REF = "examples/models/large_image_cnn.py:build"
KW = {"image_size": 64, "layers": [[4, 3, 1], [4, 3, 2]], "num_classes": 3, "in_channels": 2}


@pytest.fixture(scope="module")
def lowered():
    graph = capture_ref(REF, KW, batch_size=2)
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", data=2, spatial=4, spatial_split="grid",
                                    spatial_until="features.1")
    plan = planner.make_plan(graph, planner.Cluster.preset("local", devices=8), config, global_batch_size=4)
    return lower_plan(plan, graph, bucket_bytes=1024)


def test_every_program_names_its_tile_and_the_ranks_sharing_its_image(lowered):
    _parts, programs = lowered
    for rank, p in programs.items():
        sp = p.part("spatial")
        assert (sp.degree, sp.split, sp.grid) == (4, "grid", (2, 2))
        assert sp.ranks == tuple(range(rank // 4 * 4, rank // 4 * 4 + 4))
        assert sp.tile == divmod(rank % 4, 2) and sp.ranks[sp.index] == rank
        assert p.data_shard() == (rank // 4, 2)
        assert Program.from_dict(json.loads(json.dumps(p.to_dict()))) == p
        assert f"tile {sp.tile} of ranks {list(sp.ranks)}" in str(p)


def test_the_stage_code_runs_the_spatial_part_on_tiles_and_gathers_after_it(lowered):
    parts, _programs = lowered
    (stage,) = parts.stages
    src = stage.source
    assert "self.spatial = SpatialContext(batchnorm='sync')" in src
    assert "x_tile = spatial.take(x)" in src
    assert src.count("spatial.conv(") == 2 and src.count("spatial.batch_norm(") == 2
    assert "features_1_relu = self.spatial.gather(features_1_relu, (32, 32))" in src
    assert stage.globals["SpatialContext"] is SpatialContext
    # the layers after the spatial part run as they are
    assert "spatial" not in src.split("def layer_pool")[1]


def _doc(**spatial):
    p = Program(rank=1, world_size=2, mesh=(("data", 2),), coords=(1,), stages=(0,), num_stages=1,
                num_micro_batches=1, micro_batch_size=1, instrs=(Instr("STEP"),),
                parts=(SpatialTiles(2, "strips_h", (2, 1), (1, 0), (0, 1)),))
    d = p.to_dict()
    d["spatial"] = {**d["spatial"], **spatial}
    return d


@pytest.mark.parametrize("change,field", [(dict(grid=[2, 2]), "spatial.grid"), (dict(tile=[2, 0]), "spatial.tile"),
                                          (dict(ranks=[1, 0]), "spatial.ranks"), (dict(ranks=[0, 5]), "ranks[1]"),
                                          (dict(extra=1), "unknown key")])
def test_a_malformed_spatial_field_is_refused_naming_it(change, field):
    Program.from_dict(_doc())
    with pytest.raises(ProgramError, match=field.replace("[", r"\[")):
        Program.from_dict(_doc(**change))


def test_a_tile_that_is_not_the_ranks_own_is_refused():
    with pytest.raises(ProgramError, match="tile"):
        Program.from_dict(json.loads(json.dumps(_doc())) | {"rank": 0, "coords": [0]})
    tiles = SpatialTiles(2, "strips_h", (2, 1), (0, 0), (0, 1))
    with pytest.raises(ProgramError, match="does not hold"):
        dataclasses.replace(tiles, degree=4)


def test_a_stage_whose_tiles_were_never_given_says_so():
    with pytest.raises(SpatialError, match="attach_tiles"):
        SpatialContext().take(None)
