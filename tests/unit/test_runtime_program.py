"""runtime.program: the instruction set, its printing, JSON round trip and mesh layout."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.mesh_axes import axis_groups
from runtime.program import (Bucket, Instr, Program, ProgramError, all_axis_groups, axis_group, coords_of,
                             rank_of)
from runtime.vocab import MeshAxis

MESH = ((MeshAxis.PIPELINE, 2), ("data", 2), ("tensor", 2))


def test_instructions_print_compactly():
    assert str(Instr("F", 1, 3)) == "F s1 m3"
    assert str(Instr("B", 0, 0)) == "B s0 m0"
    assert str(Instr("SEND", 1, 3, peer=5, kind="act", handle=4, nbytes=4096)) == "SEND act s1 m3 -> r5 h4 (4.0 KiB)"
    assert str(Instr("RECV", 1, 3, peer=1, kind="grad", handle=7)) == "RECV grad s1 m3 <- r1 h7"
    assert str(Instr("ALLREDUCE", 1, kind="grads", axis="data", handle=2, bucket=0, nbytes=3 * 2**20)) == \
        "ALLREDUCE grads s1 b0 @data h2 (3.0 MiB)"
    assert str(Instr("BROADCAST", kind="loss", axis=MeshAxis.PIPELINE, peer=7, handle=9, nbytes=8)) == \
        f"BROADCAST loss @{MeshAxis.PIPELINE} <- r7 h9 (8 B)"
    assert str(Instr("WAIT", handle=4)) == "WAIT h4"
    assert str(Instr("STEP")) == "STEP" and str(Instr("ZERO_GRAD")) == "ZERO_GRAD"


@pytest.mark.parametrize("bad", [
    dict(op="FWD"), dict(op="F", stage=0), dict(op="SEND", stage=0, micro=0, kind="act", handle=1),
    dict(op="ALLREDUCE", kind="grads", handle=1), dict(op="WAIT"), dict(op="F", stage=0, micro=0, kind="x"),
])
def test_malformed_instructions_are_value_errors(bad):
    with pytest.raises(ProgramError):
        Instr(**bad)


def _program():
    instrs = (Instr("ZERO_GRAD"), Instr("RECV", 0, 0, peer=1, kind="act", handle=0, nbytes=64), Instr("WAIT", handle=0),
              Instr("F", 1, 0), Instr("B", 1, 0), Instr("SEND", 0, 0, peer=1, kind="grad", handle=1, nbytes=64),
              Instr("ALLREDUCE", 1, kind="grads", axis="data", handle=2, bucket=0, nbytes=128),
              Instr("WAIT", handle=1), Instr("WAIT", handle=2), Instr("STEP"))
    return Program(rank=5, world_size=8, mesh=MESH, coords=(1, 0, 1), stages=(1,), num_stages=2,
                   num_micro_batches=1, micro_batch_size=4, instrs=instrs,
                   buckets=(Bucket(1, ("fc.weight", "fc.bias"), 30, 128),))


def test_program_json_round_trip(tmp_path):
    p = _program()
    assert Program.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert Program.from_json(p.to_json()) == p
    p.save(tmp_path / "p.json")
    assert Program.load(tmp_path / "p.json") == p


def test_programs_written_with_the_old_axis_names_still_load():
    """Builds made before the mesh axes took the ParallelConfig names spelled them "pipe" and "branch"."""
    doc = _program().to_dict()
    doc["mesh"] = [["pipe", 2], ["data", 2], ["tensor", 2]]
    doc["instrs"].insert(-1, {"op": "BROADCAST", "kind": "loss", "axis": "pipe", "peer": 5, "handle": 9, "nbytes": 8})
    doc["instrs"].insert(-1, {"op": "WAIT", "handle": 9})
    p = Program.from_dict(doc)
    assert [a for a, _ in p.mesh] == [MeshAxis.PIPELINE, MeshAxis.DATA, MeshAxis.TENSOR]
    assert p.instrs[-3].axis == MeshAxis.PIPELINE and p.group(MeshAxis.PIPELINE) == (1, 5)
    assert Program.from_dict({**doc, "mesh": [["pipe", 1], ["data", 2], ["branch", 4]], "coords": [0, 0, 1], "rank": 1,
                              "instrs": doc["instrs"][:1]}).mesh_dict == {"pipeline": 1, "data": 2, "subgraph": 4}


def test_program_prints_one_instruction_per_line():
    text = str(_program())
    lines = text.splitlines()
    assert lines[0].startswith("# rank 5 of 8") and f"coords {MeshAxis.PIPELINE}=1 data=0 tensor=1" in lines[0]
    assert lines[1:] == [str(i) for i in _program().instrs]


def test_program_groups_and_coordinates():
    p = _program()
    assert p.group("tensor") == (4, 5) and p.group("data") == (5, 7) and p.group(MeshAxis.PIPELINE) == (1, 5)
    assert p.coord("tensor") == 1 and p.count("WAIT") == 3
    with pytest.raises(ProgramError, match="coords"):
        Program(rank=4, world_size=8, mesh=MESH, coords=(1, 0, 1), stages=(1,), num_stages=2, num_micro_batches=1,
                micro_batch_size=1, instrs=())
    with pytest.raises(ProgramError, match="format_version"):
        Program.from_dict({**p.to_dict(), "format_version": 99})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_mesh_layout_matches_the_cost_model(sizes):
    mesh = tuple((f"a{i}", s) for i, s in enumerate(sizes))
    world = 1
    for s in sizes:
        world *= s
    for r in range(world):
        assert rank_of(mesh, coords_of(mesh, r)) == r
    for axis, _ in mesh:
        assert [list(g) for g in all_axis_groups(mesh, axis)] == axis_groups(dict(mesh), axis)
        for r in range(world):
            assert r in axis_group(mesh, coords_of(mesh, r), axis)
