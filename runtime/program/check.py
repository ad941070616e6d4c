"""Validation of a Program document (programs.json, one entry) before any field is used.

`check_program_dict` checks every field's type and range and the cross-references
between them: coordinates inside the mesh, stages of the pipeline, buckets of
this rank's stages, peers inside the world, axes that exist, handles created once
and waited on only after they were created. Each problem raises ProgramError whose
message names the field by its path ("instrs[12].peer") and what it should be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from runtime.documents import FieldError, Fields
from runtime.parallel.parts import PARTS
from runtime.program.instr_set import COLLECTIVE_OPS, KINDS, OPS, P2P_OPS, PROGRAM_FORMAT_VERSION, TIE_AXIS, Op, ProgramError
from runtime.program.mesh import MeshError
from runtime.vocab import current_axis_name

GroupOf = Callable[[Sequence[tuple[str, int]], Sequence[int], str], tuple[int, ...]]

_TOP = ("format_version", "rank", "world_size", "mesh", "coords", "stages", "num_stages", "num_micro_batches",
        "micro_batch_size", "zero", "buckets", "instrs", "ties") + tuple(k.key for k in PARTS)
_REQUIRED = ("format_version", "rank", "world_size", "mesh", "coords", "stages", "num_stages", "num_micro_batches",
             "micro_batch_size", "instrs")
_BUCKET = ("stage", "params", "numel", "nbytes")
_BUCKET_KEYS = _BUCKET + ("decay",)   # decay: optional (default true)
_TIE = ("index", "name", "copies", "owned", "axis")
_INSTR_INT = ("stage", "micro", "peer", "handle", "bucket", "nbytes")
_INSTR_STR = ("op", "kind", "axis")


_WHERE = "Program"
_FIX = "generate the build again (meshplan codegen)"


def check_program_dict(d: Any, axis_group: GroupOf) -> None:
    """Raise ProgramError naming the first malformed field of a Program document.

    axis_group(mesh, coords, axis): the ranks of the group along a mesh or derived axis; it
    raises ProgramError or MeshError for an axis the mesh cannot resolve. Program.from_dict
    passes runtime.program.axis_group: runtime/program/__init__.py imports this module, so it hands
    the function in rather than this module importing it back."""
    try:
        _check(Fields(d, _WHERE), axis_group)
    except FieldError as e:
        raise ProgramError(f"{e}; {_FIX}") from None


def _check(f: Fields, axis_group: GroupOf) -> None:
    """The whole document, in the order its problems are reported: header, mesh, stages, step sizes,
    buckets, ties, strategy parts, then each instruction."""
    f.only(_TOP, _REQUIRED)
    world = _check_header(f)
    mesh, coords = _check_mesh(f, world)
    num_stages = f.integer("num_stages", minimum=1)
    stages = f.items("stages")
    for i, s in enumerate(stages):
        f.whole(f"stages[{i}]", s, minimum=0, maximum=num_stages - 1)
    if len(set(stages)) != len(stages) or stages != sorted(stages):
        raise f.error("stages", f"must be distinct and ascending, got {stages}")
    micros = f.integer("num_micro_batches", minimum=1)
    f.integer("micro_batch_size", minimum=1)
    if "zero" in f.data:
        f.integer("zero", minimum=0, maximum=3)
    buckets = f.each("buckets", lambda b: _check_bucket(b, stages), [])
    ties = _check_ties(f, stages, mesh, coords, axis_group) if "ties" in f.data else set()
    for part in PARTS:
        if part.key in f.data:
            part.check_document(f.sub(part.key), world, f.raw("rank"))
    shape = _RankShape(world, tuple(mesh), tuple(coords), tuple(stages), num_stages, micros, len(buckets),
                      frozenset(ties), axis_group)
    created: set[int] = set()
    for i, ins in enumerate(f.items("instrs")):
        _check_instr(Fields(ins, _WHERE, f"instrs[{i}]"), ins, shape, created)


def _check_header(f: Fields) -> int:
    """The format version and the rank inside the world; returns the world size."""
    version = f.raw("format_version")
    if version != PROGRAM_FORMAT_VERSION or isinstance(version, bool):
        raise f.error("format_version", f"is {version!r}; this runtime reads {PROGRAM_FORMAT_VERSION}")
    world = f.integer("world_size", minimum=1)
    f.integer("rank", minimum=0, maximum=world - 1)  # checked; nothing below depends on it
    return world


def _check_mesh(f: Fields, world: int) -> tuple[list[tuple[str, int]], list]:
    """The mesh ([(axis name, size)], current names, sizes multiplying to the world) and this rank's
    coordinate along each of its axes."""
    mesh = []
    for i, pair in enumerate(f.items("mesh")):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and pair[0]):
            raise f.error(f"mesh[{i}]", f"must be [axis name, size], got {pair!r}")
        mesh.append((current_axis_name(pair[0]), f.whole(f"mesh[{i}][1]", pair[1], minimum=1, maximum=world)))
    names = [a for a, _ in mesh]
    if len(set(names)) != len(names):
        raise f.error("mesh", f"names an axis twice: {names}")
    if math.prod(s for _, s in mesh) != world:
        raise f.error("mesh", f"has {math.prod(s for _, s in mesh)} ranks but world_size is {world}")
    coords = f.items("coords")
    if len(coords) != len(mesh):
        raise f.error("coords", f"has {len(coords)} entries for the {len(mesh)} mesh axes {names}")
    for i, c in enumerate(coords):
        f.whole(f"coords[{i}]", c, minimum=0, maximum=mesh[i][1] - 1)
    return mesh, coords


@dataclass(frozen=True)
class _RankShape:
    """What an instruction's fields are checked against, from the checked top of the document."""

    world: int
    mesh: tuple[tuple[str, int], ...]
    coords: tuple[int, ...]
    stages: tuple[int, ...]       # this rank's stages, ascending
    num_stages: int
    num_micro_batches: int
    num_buckets: int
    ties: frozenset[int]          # the tied weights' indices this rank holds
    axis_group: GroupOf

    @property
    def names(self) -> list[str]:
        return [a for a, _ in self.mesh]


def _check_instr(g: Fields, ins: dict, shape: _RankShape, created: set[int]) -> None:
    """One instruction's fields and references; adds the handle it creates to `created`."""
    g.only(_INSTR_INT + _INSTR_STR, ("op",))
    for k in _INSTR_STR:
        if k in ins:
            g.text(k)
    for k in _INSTR_INT:
        if k in ins:
            g.integer(k, minimum=0 if k == "nbytes" else -1)
    op, kind, axis = ins["op"], ins.get("kind", ""), current_axis_name(ins.get("axis", ""))
    if op not in OPS:
        raise g.error("op", f"is {op!r}; known: {', '.join(OPS)}")
    if kind not in KINDS:
        raise g.error("kind", f"is {kind!r}; known: {', '.join(k for k in KINDS if k)}")
    _check_instr_place(g, ins, op, shape)
    if axis:
        _check_instr_axis(g, ins.get("peer", -1), op, axis, shape)
    bucket = ins.get("bucket", -1)
    if kind == "tied":
        if bucket not in shape.ties:
            raise g.error("bucket", f"is {bucket}; this rank holds tied weights {sorted(shape.ties)}")
    elif bucket >= shape.num_buckets or (op in COLLECTIVE_OPS and kind in ("grads", "params") and bucket < 0):
        raise g.error("bucket", f"is {bucket}; this rank has {shape.num_buckets} bucket(s)")
    handle = ins.get("handle", -1)
    if op in P2P_OPS or op in COLLECTIVE_OPS:
        if handle in created:
            raise g.error("handle", f"h{handle} is created twice")
        if handle >= 0:
            created.add(handle)
    elif op == Op.WAIT and handle >= 0 and handle not in created:
        raise g.error("handle", f"waits on h{handle}, which no earlier instruction creates")


def _check_instr_place(g: Fields, ins: dict, op: str, shape: _RankShape) -> None:
    """An instruction's stage, micro-batch and peer inside the pipeline, the step and the world."""
    stage, micro = ins.get("stage", -1), ins.get("micro", -1)
    if op in (Op.F, Op.B) and stage not in shape.stages:
        raise g.error("stage", f"is {stage}, not one of this rank's stages {list(shape.stages)}")
    if stage >= shape.num_stages:
        raise g.error("stage", f"is {stage}, the pipeline has {shape.num_stages} stages")
    if micro >= shape.num_micro_batches:
        raise g.error("micro", f"is {micro}, a step has {shape.num_micro_batches} micro-batches")
    peer = ins.get("peer", -1)
    if peer >= shape.world:
        raise g.error("peer", f"is rank {peer}, outside the world of {shape.world} ranks")


def _check_instr_axis(g: Fields, peer: int, op: str, axis: str, shape: _RankShape) -> None:
    """An instruction's axis resolves to a group of this rank, and a broadcast's root is in it."""
    try:
        group = shape.axis_group(list(shape.mesh), list(shape.coords), axis)
    except (ProgramError, MeshError):
        raise g.error("axis", f"is {axis!r}, not an axis of the mesh {shape.names}") from None
    if op == Op.BROADCAST and peer not in group:
        raise g.error("peer", f"is rank {peer}, not in this rank's {axis} group {list(group)}")


def _check_bucket(b: Fields, stages: list) -> None:
    b.only(_BUCKET_KEYS, _BUCKET)
    b.boolean("decay", True)
    s = b.integer("stage")
    if s not in stages:
        raise b.error("stage", f"is {s}, not one of this rank's stages {stages}")
    if not all(isinstance(p, str) and p for p in b.items("params")):
        raise b.error("params", "must be a list of parameter names")
    b.integer("numel", minimum=0)
    b.integer("nbytes", minimum=0)


def _check_ties(f: Fields, stages: list, mesh: list, coords: list, axis_group: GroupOf) -> set[int]:
    """The tied weights' indices, after checking each entry of "ties"."""

    out: set[int] = set()
    for i, entry in enumerate(f.items("ties")):
        t = Fields(entry, _WHERE, f"ties[{i}]")
        t.only(_TIE, _TIE)
        index = t.integer("index", minimum=0)
        if index in out:
            raise t.error("index", f"names tied weight {index} twice")
        out.add(index)
        if not t.text("name"):
            raise t.error("name", "must be the weight's name")
        for k, c in enumerate(t.items("copies")):
            if not (isinstance(c, list) and len(c) == 2 and isinstance(c[1], str) and c[1]):
                raise t.error(f"copies[{k}]", f"must be [stage, parameter name], got {c!r}")
            s = t.whole(t.path(f"copies[{k}][0]"), c[0])
            if s not in stages:
                raise t.error(f"copies[{k}][0]", f"is {s}, not one of this rank's stages {stages}")
        held = {c[0] for c in entry["copies"]}
        for k, s in enumerate(t.items("owned")):
            if s not in held:
                raise t.error(f"owned[{k}]", f"is stage {s}, which holds no copy here")
        axis = t.raw("axis")
        if not (isinstance(axis, str) and axis.startswith(TIE_AXIS)):
            raise t.error("axis", f"must be a 'tie:I,J' axis, got {axis!r}")
        try:
            axis_group(mesh, coords, axis)
        except (ProgramError, MeshError):
            raise t.error("axis", f"is {axis!r}, which names no pipeline positions of the mesh") from None
    return out
