"""Validation of a Program document (programs.json, one entry) before any field is used.

`check_program_dict` checks every field's type and range and the cross-references
between them: coordinates inside the mesh, stages of the pipeline, buckets of
this rank's stages, peers inside the world, axes that exist, handles created once
and waited on only after they were created. Each problem raises ProgramError whose
message names the field by its path ("instrs[12].peer") and what it should be.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from runtime.vocab import current_axis_name

_TOP = ("format_version", "rank", "world_size", "mesh", "coords", "stages", "num_stages", "num_micro_batches",
        "micro_batch_size", "zero", "buckets", "instrs", "ties")
_BUCKET = ("stage", "params", "numel", "nbytes")
_BUCKET_KEYS = _BUCKET + ("decay",)   # decay: optional (default true)
_TIE = ("index", "name", "copies", "owned", "axis")
_INSTR_INT = ("stage", "micro", "peer", "handle", "bucket", "nbytes")
_INSTR_STR = ("op", "kind", "axis")


def _err(field: str, problem: str):
    from runtime.program import ProgramError

    return ProgramError(f"Program field '{field}' {problem}; generate the build again (meshplan codegen)")


def _int(d: Mapping, key: str, field: str, lo: int | None = None, hi: int | None = None) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(field, f"must be a whole number, got {v!r}")
    if lo is not None and v < lo:
        raise _err(field, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise _err(field, f"must be <= {hi}, got {v}")
    return v


def _list(d: Mapping, key: str, field: str) -> list:
    v = d[key]
    if not isinstance(v, list):
        raise _err(field, f"must be a list, got {type(v).__name__}")
    return v


def _keys(d: Any, field: str, known: tuple[str, ...], required: tuple[str, ...]) -> None:
    if not isinstance(d, Mapping):
        raise _err(field, f"must be an object, got {type(d).__name__}")
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise _err(field, f"has unknown key(s) {unknown}; known: {list(known)}")
    for k in required:
        if k not in d:
            raise _err(f"{field}.{k}" if field else k, "is missing")


def check_program_dict(d: Any) -> None:
    """Raise ProgramError naming the first malformed field of a Program document."""
    from runtime.program import COLLECTIVE_OPS, KINDS, OPS, P2P_OPS, PROGRAM_FORMAT_VERSION, ProgramError, \
        axis_group

    _keys(d, "", _TOP, tuple(k for k in _TOP if k not in ("zero", "buckets", "ties")))
    if d["format_version"] != PROGRAM_FORMAT_VERSION or isinstance(d["format_version"], bool):
        raise _err("format_version", f"is {d['format_version']!r}; this runtime reads {PROGRAM_FORMAT_VERSION}")
    world = _int(d, "world_size", "world_size", 1)
    _int(d, "rank", "rank", 0, world - 1)  # checked; nothing below depends on it
    mesh = []
    for i, pair in enumerate(_list(d, "mesh", "mesh")):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and pair[0]):
            raise _err(f"mesh[{i}]", f"must be [axis name, size], got {pair!r}")
        mesh.append((current_axis_name(pair[0]), _int({"s": pair[1]}, "s", f"mesh[{i}][1]", 1, world)))
    names = [a for a, _ in mesh]
    if len(set(names)) != len(names):
        raise _err("mesh", f"names an axis twice: {names}")
    if math.prod(s for _, s in mesh) != world:
        raise _err("mesh", f"has {math.prod(s for _, s in mesh)} ranks but world_size is {world}")
    coords = _list(d, "coords", "coords")
    if len(coords) != len(mesh):
        raise _err("coords", f"has {len(coords)} entries for the {len(mesh)} mesh axes {names}")
    for i, c in enumerate(coords):
        _int({"c": c}, "c", f"coords[{i}]", 0, mesh[i][1] - 1)
    num_stages = _int(d, "num_stages", "num_stages", 1)
    stages = _list(d, "stages", "stages")
    for i, s in enumerate(stages):
        _int({"s": s}, "s", f"stages[{i}]", 0, num_stages - 1)
    if len(set(stages)) != len(stages) or stages != sorted(stages):
        raise _err("stages", f"must be distinct and ascending, got {stages}")
    micros = _int(d, "num_micro_batches", "num_micro_batches", 1)
    _int(d, "micro_batch_size", "micro_batch_size", 1)
    if "zero" in d:
        _int(d, "zero", "zero", 0, 3)
    buckets = _list(d, "buckets", "buckets") if "buckets" in d else []
    for i, b in enumerate(buckets):
        f = f"buckets[{i}]"
        _keys(b, f, _BUCKET_KEYS, _BUCKET)
        if not isinstance(b.get("decay", True), bool):
            raise _err(f"{f}.decay", "must be true or false")
        s = _int(b, "stage", f"{f}.stage")
        if s not in stages:
            raise _err(f"{f}.stage", f"is {s}, not one of this rank's stages {stages}")
        params = _list(b, "params", f"{f}.params")
        if not all(isinstance(p, str) and p for p in params):
            raise _err(f"{f}.params", "must be a list of parameter names")
        _int(b, "numel", f"{f}.numel", 0)
        _int(b, "nbytes", f"{f}.nbytes", 0)
    ties = _check_ties(d, stages, mesh, coords) if "ties" in d else set()
    created: set[int] = set()
    for i, ins in enumerate(_list(d, "instrs", "instrs")):
        f = f"instrs[{i}]"
        _keys(ins, f, _INSTR_INT + _INSTR_STR, ("op",))
        for k in _INSTR_STR:
            if k in ins and not isinstance(ins[k], str):
                raise _err(f"{f}.{k}", f"must be a string, got {ins[k]!r}")
        for k in _INSTR_INT:
            if k in ins:
                _int(ins, k, f"{f}.{k}", 0 if k == "nbytes" else -1)
        op, kind, axis = ins["op"], ins.get("kind", ""), current_axis_name(ins.get("axis", ""))
        if op not in OPS:
            raise _err(f"{f}.op", f"is {op!r}; known: {', '.join(OPS)}")
        if kind not in KINDS:
            raise _err(f"{f}.kind", f"is {kind!r}; known: {', '.join(k for k in KINDS if k)}")
        stage, micro = ins.get("stage", -1), ins.get("micro", -1)
        if op in ("F", "B") and stage not in stages:
            raise _err(f"{f}.stage", f"is {stage}, not one of this rank's stages {stages}")
        if stage >= num_stages:
            raise _err(f"{f}.stage", f"is {stage}, the pipeline has {num_stages} stages")
        if micro >= micros:
            raise _err(f"{f}.micro", f"is {micro}, a step has {micros} micro-batches")
        peer = ins.get("peer", -1)
        if peer >= world:
            raise _err(f"{f}.peer", f"is rank {peer}, outside the world of {world} ranks")
        if axis:
            try:
                group = axis_group(mesh, coords, axis)
            except ProgramError:
                raise _err(f"{f}.axis", f"is {axis!r}, not an axis of the mesh {names}") from None
            if op == "BROADCAST" and peer not in group:
                raise _err(f"{f}.peer", f"is rank {peer}, not in this rank's {axis} group {list(group)}")
        bucket = ins.get("bucket", -1)
        if kind == "tied":
            if bucket not in ties:
                raise _err(f"{f}.bucket", f"is {bucket}; this rank holds tied weights {sorted(ties)}")
        elif bucket >= len(buckets) or (op in COLLECTIVE_OPS and kind in ("grads", "params") and bucket < 0):
            raise _err(f"{f}.bucket", f"is {bucket}; this rank has {len(buckets)} bucket(s)")
        handle = ins.get("handle", -1)
        if op in P2P_OPS or op in COLLECTIVE_OPS:
            if handle in created:
                raise _err(f"{f}.handle", f"h{handle} is created twice")
            if handle >= 0:
                created.add(handle)
        elif op == "WAIT" and handle >= 0 and handle not in created:
            raise _err(f"{f}.handle", f"waits on h{handle}, which no earlier instruction creates")


def _check_ties(d: Mapping, stages: list, mesh: list, coords: list) -> set[int]:
    """The tied weights' indices, after checking each entry of "ties"."""
    from runtime.program import TIE_AXIS, ProgramError, axis_group

    out: set[int] = set()
    for i, t in enumerate(_list(d, "ties", "ties")):
        f = f"ties[{i}]"
        _keys(t, f, _TIE, _TIE)
        index = _int(t, "index", f"{f}.index", 0)
        if index in out:
            raise _err(f"{f}.index", f"names tied weight {index} twice")
        out.add(index)
        if not isinstance(t["name"], str) or not t["name"]:
            raise _err(f"{f}.name", "must be the weight's name")
        for k, c in enumerate(_list(t, "copies", f"{f}.copies")):
            if not (isinstance(c, list) and len(c) == 2 and isinstance(c[1], str) and c[1]):
                raise _err(f"{f}.copies[{k}]", f"must be [stage, parameter name], got {c!r}")
            s = _int({"s": c[0]}, "s", f"{f}.copies[{k}][0]")
            if s not in stages:
                raise _err(f"{f}.copies[{k}][0]", f"is {s}, not one of this rank's stages {stages}")
        held = {c[0] for c in t["copies"]}
        for k, s in enumerate(_list(t, "owned", f"{f}.owned")):
            if s not in held:
                raise _err(f"{f}.owned[{k}]", f"is stage {s}, which holds no copy here")
        axis = t["axis"]
        if not (isinstance(axis, str) and axis.startswith(TIE_AXIS)):
            raise _err(f"{f}.axis", f"must be a 'tie:I,J' axis, got {axis!r}")
        try:
            axis_group(mesh, coords, axis)
        except ProgramError:
            raise _err(f"{f}.axis", f"is {axis!r}, which names no pipeline positions of the mesh") from None
    return out
