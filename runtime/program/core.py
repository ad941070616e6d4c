"""The instruction set: what one rank does in one training step.

A `Program` is one rank's ordered list of `Instr`. The planner decides
everything ahead of time; the executor (runtime/executor.py) only walks the
list, and the simulator prices the same list, so predictions can be checked
instruction by instruction.

Instructions (op, and how `str()` prints them):

    F s1 m3                       forward of stage 1 for micro-batch 3
    B s1 m3                       backward of stage 1 for micro-batch 3
    SEND act s1 m3 -> r5 h4       stage 1's output for micro-batch 3, to rank 5 (stage 2)
    RECV act s1 m3 <- r1 h0       the same message at rank 5 (posted early)
    SEND grad s1 m3 -> r1 h6      its gradient, from stage 2's backward, back to rank 1
    RECV grad s1 m3 <- r5 h7      the same message at rank 1
    ALLREDUCE grads s1 b0 @data h2   bucket 0 of stage 1's gradients over the data axis
    REDUCESCATTER grads s1 b0 @data h2 / ALLGATHER params s1 b0 @data h3
    BROADCAST loss @pipeline <- r7 h9 the step's loss, from the last stage's rank
    ALLREDUCE tied b0 @tie:0,1 h5 the gradients of tied weight 0's copies (Program.ties), summed
                                  over the pipeline positions holding one
    ALLREDUCE stats s0 @data h8   stage 0's BatchNorm running statistics, averaged over data
    WAIT h4                       block until handle 4 completes
    ZERO_GRAD / STEP              clear gradient buffers / optimizer step

A message is named by the cut it crosses (stage s's output), so both ends
of a SEND/RECV pair carry the same stage and micro-batch.

SEND, RECV and collectives are asynchronous: they return a handle that a
later WAIT completes. A collective on `grads` that directly follows the
last backward of its stage is issued from inside that backward, as soon as
its bucket's gradients are ready (overlap); its place in the list is the
latest point it may start. `nbytes` is the payload this rank sends or
reduces (the full buffer for collectives), for the simulator.

Mesh: axes outermost first (pipeline, data, tensor; runtime.vocab.MeshAxis); ranks are laid out
row-major with the last axis fastest, as cost_models.mesh_axes.axis_groups does.
Besides the mesh axes, a collective may name the derived axis "pair" (GEMS
bi-directional pipelines): the ranks at pipeline positions i and p-1-i, across
every data coordinate, with the same other coordinates; or "tie:I,J,...": the ranks at
pipeline positions I, J, ... with the same other coordinates (the holders of a tied
weight's copies, Megatron's embedding group).

Strategies whose ranks split one sample among themselves (spatial tiles of an image, context
chunks of a sequence) add a part (runtime/program/parts.py), stored under the strategy's name:
the sample's pieces are `degree` consecutive coordinates of the data axis, which then holds
data x degree ranks, so the gradient, statistics, ZeRO and loss collectives on the data axis
reduce over data x degree (Megatron reduces gradients and shards its distributed optimizer over
data x context alike).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Iterable, Mapping

from runtime.program.instr_set import (COLLECTIVE_OPS, COMPUTE_OPS, KINDS, OPS, P2P_KINDS, P2P_OPS, PAIR_AXIS,
                               PROGRAM_FORMAT_VERSION, TIE_AXIS, Kind, Op, ProgramError)
from runtime.program.mesh import MeshError, coords_of, group_along, rank_of
from runtime.parallel.parts import PARTS
from runtime.program.check import check_program_dict
from runtime.program.parts import ProgramPart, find_part, put_part
from runtime.documents import parse_document, read_document, refuse_unknown_fields
from runtime.vocab import MeshAxis, current_axis_name



def _unreadable(message: str) -> ProgramError:
    """A Program file that does not read as a JSON object (runtime.documents names the problem)."""
    return ProgramError(f"{message}; generate the build again")


@dataclass(frozen=True)
class Instr:
    """One instruction. Unused fields keep their defaults (-1 or "")."""

    op: str
    stage: int = -1
    micro: int = -1
    peer: int = -1        # SEND/RECV partner, BROADCAST source (global ranks)
    kind: str = ""        # act, grad, grads, params, loss
    axis: str = ""        # mesh axis a collective runs on
    handle: int = -1      # async handle this instruction creates (or WAIT completes)
    bucket: int = -1      # index into Program.buckets for grads/params collectives
    nbytes: int = 0       # bytes this rank moves

    def __post_init__(self) -> None:
        # a MeshAxis member is kept as its plain name: Programs print, compare and load as text
        object.__setattr__(self, "axis", str(self.axis))
        if self.op not in OPS:
            raise ProgramError(f"unknown instruction op {self.op!r}; known: {', '.join(OPS)}")
        if self.kind not in KINDS:
            raise ProgramError(f"unknown instruction kind {self.kind!r}; known: {', '.join(k for k in KINDS if k)}")
        # the text of a file (or a caller's string) becomes the member: the executor's table is keyed by them
        object.__setattr__(self, "op", Op(self.op))
        object.__setattr__(self, "kind", Kind(self.kind))
        if self.op in COMPUTE_OPS and (self.stage < 0 or self.micro < 0):
            raise ProgramError(f"{self.op} needs a stage and a micro-batch, got stage={self.stage} micro={self.micro}")
        if self.op in P2P_OPS and (self.peer < 0 or self.handle < 0 or self.kind not in P2P_KINDS):
            raise ProgramError(f"{self.op} needs kind act/grad, a peer and a handle: {self}")
        if self.op in COLLECTIVE_OPS and (not self.axis or self.handle < 0):
            raise ProgramError(f"{self.op} needs an axis and a handle: {self}")
        if self.op == Op.WAIT and self.handle < 0:
            raise ProgramError("WAIT needs a handle")

    @property
    def is_async(self) -> bool:
        return self.op in P2P_OPS or self.op in COLLECTIVE_OPS

    def __str__(self) -> str:
        op = self.op
        if op in COMPUTE_OPS:
            return f"{op} s{self.stage} m{self.micro}"
        if op == Op.WAIT:
            return f"WAIT h{self.handle}"
        if op in (Op.STEP, Op.ZERO_GRAD):
            return str(op)
        parts = [op, self.kind]
        if self.stage >= 0:
            parts.append(f"s{self.stage}")
        if self.micro >= 0:
            parts.append(f"m{self.micro}")
        if self.bucket >= 0:
            parts.append(f"b{self.bucket}")
        if op == Op.SEND:
            parts.append(f"-> r{self.peer}")
        elif op == Op.RECV:
            parts.append(f"<- r{self.peer}")
        else:
            parts.append(f"@{self.axis}")
            if op == Op.BROADCAST:
                parts.append(f"<- r{self.peer}")
        parts.append(f"h{self.handle}")
        if self.nbytes:
            parts.append(f"({_fmt_bytes(self.nbytes)})")
        return " ".join(parts)

    def to_dict(self) -> dict:
        """Only the fields that differ from the defaults (compact JSON)."""
        out = {"op": str(self.op)}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "op" and v != f.default:
                out[f.name] = str(v) if f.name == "kind" else v   # plain text: a document, and a Python literal
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> "Instr":
        """Axis names of older files ("pipe", "branch") are read as today's (runtime.vocab.OLD_AXIS_NAMES)."""
        refuse_unknown_fields(d, cls, "instruction", ProgramError)
        d = dict(d)
        if "axis" in d:
            d["axis"] = current_axis_name(d["axis"])
        return cls(**d)


@dataclass(frozen=True)
class Bucket:
    """A group of one stage's parameters whose gradients travel together.

    `params` are the stage module's parameter names (tensor-parallel local
    shapes); `numel` is their total element count; `nbytes` the bytes of the
    gradient buffer (padded to a multiple of the data degree); `decay`: its parameters are
    in the weight-decayed optimizer group (runtime/execute/optim.py; a bucket never mixes the groups
    where they differ, so a ZeRO shard of it belongs to one).
    """

    stage: int
    params: tuple[str, ...]
    numel: int
    nbytes: int
    decay: bool = True


@dataclass(frozen=True)
class Tie:
    """A weight the model uses in several stages (tied embeddings), as this rank holds it.

    Every stage that uses it holds a copy; the copies start equal and, before each optimizer
    step, every copy's gradient is replaced by the sum over all copies (each stage's gradient
    counted once), so they stay equal. `index` numbers the model's tied weights (the same on
    every rank; ALLREDUCE tied names it in its `bucket` field); `name` is the model's name of
    the weight; `copies` are (stage, the stage module's parameter name) on this rank;
    `owned` the stages whose gradient this rank adds to the sum (a stage run by several
    ranks of the group, as GEMS runs each stage twice, is added by one of them); `axis`
    the group ("tie:I,J": the pipeline positions holding a copy).
    """

    index: int
    name: str
    copies: tuple[tuple[int, str], ...]
    owned: tuple[int, ...]
    axis: str

    def to_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "copies": [list(c) for c in self.copies],
                "owned": list(self.owned), "axis": self.axis}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Tie":
        return cls(int(d["index"]), str(d["name"]), tuple((int(s), str(n)) for s, n in d["copies"]),
                   tuple(int(s) for s in d["owned"]), str(d["axis"]))


@dataclass(frozen=True)
class Program:
    """One rank's instructions for one training step.

    Attributes:
        rank, world_size: this process and the number of processes.
        mesh: (axis, size) pairs, outermost first; sizes multiply to world_size.
        coords: this rank's coordinate on each axis, in mesh order.
        stages: the pipeline stages (chunks) this rank runs, ascending.
        num_stages: stages of the whole pipeline.
        num_micro_batches, micro_batch_size: per step, per data rank.
        zero: ZeRO stage (0-3) the collectives implement.
        buckets: gradient buckets the grads/params collectives name by index.
        instrs: the instructions, in order.
        ties: the tied weights this rank holds copies of (see Tie).
        parts: what strategies that split samples among ranks add (runtime/program/parts.py: spatial
            tiles, context chunks), in runtime.parallel.parts.PARTS order; `part(key)` finds one.
    """

    rank: int
    world_size: int
    mesh: tuple[tuple[str, int], ...]
    coords: tuple[int, ...]
    stages: tuple[int, ...]
    num_stages: int
    num_micro_batches: int
    micro_batch_size: int
    instrs: tuple[Instr, ...]
    zero: int = 0
    buckets: tuple[Bucket, ...] = ()
    ties: tuple[Tie, ...] = ()
    parts: tuple[ProgramPart, ...] = ()
    format_version: int = PROGRAM_FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", tuple((str(a), int(s)) for a, s in self.mesh))
        object.__setattr__(self, "coords", tuple(int(c) for c in self.coords))
        if math.prod(s for _, s in self.mesh) != self.world_size:
            raise ProgramError(f"mesh {dict(self.mesh)} has {math.prod(s for _, s in self.mesh)} ranks, "
                               f"but world_size is {self.world_size}")
        if len(self.coords) != len(self.mesh):
            raise ProgramError(f"coords {self.coords} do not match mesh axes {[a for a, _ in self.mesh]}")
        try:
            rank = rank_of(self.mesh, self.coords)
        except MeshError as e:
            raise ProgramError(f"coords {self.coords}: {e}") from None
        if rank != self.rank:
            raise ProgramError(f"coords {self.coords} are rank {rank}, not {self.rank}")
        keys = [p.key for p in self.parts]
        if keys != [k.key for k in PARTS if k.key in keys]:
            raise ProgramError(f"parts {keys} must be distinct and in the order {[k.key for k in PARTS]}")
        for part in self.parts:
            part.check_rank(self.rank)

    # ---- views ----------------------------------------------------------
    @property
    def mesh_dict(self) -> dict[str, int]:
        return dict(self.mesh)

    def coord(self, axis: str) -> int:
        names = [a for a, _ in self.mesh]
        if axis not in names:
            raise ProgramError(f"unknown mesh axis {axis!r}; the mesh has {names}")
        return self.coords[names.index(axis)]

    def group(self, axis: str) -> tuple[int, ...]:
        """The global ranks of this rank's group along `axis`, in coordinate order."""
        return axis_group(self.mesh, self.coords, axis)

    @property
    def derived_axes(self) -> tuple[str, ...]:
        """Axes the instructions name that are not mesh axes (e.g. "pair"), sorted."""
        names = {a for a, _ in self.mesh}
        return tuple(sorted({i.axis for i in self.instrs if i.axis and i.axis not in names}))

    @property
    def grad_axis(self) -> str:
        """The axis this rank's gradient buckets are reduced over ("data" unless a grads
        collective names another)."""
        return next((i.axis for i in self.instrs if i.kind == Kind.GRADS), "data")

    def data_shard(self) -> tuple[int, int]:
        """(the data shard this rank reads, the number of shards): its data coordinate of the data
        axis's size, or with parts that split samples (spatial tiles, context chunks), its sample's
        run of consecutive coordinates (see ProgramPart.degree)."""
        names = [a for a, _ in self.mesh]
        coord, size = (self.coord("data"), self.mesh_dict["data"]) if "data" in names else (0, 1)
        run = math.prod(p.degree for p in self.parts)
        return coord // run, size // run

    def part(self, key: str) -> ProgramPart | None:
        """The part the strategy `key` (a runtime.vocab.StrategyName) added, or None."""
        return find_part(self.parts, key)

    def with_part(self, part: ProgramPart) -> "Program":
        """This Program with `part` added (or put in place of the part under the same key)."""
        return replace(self, parts=put_part(self.parts, part, PARTS))

    def tie(self, index: int) -> Tie:
        """The tied weight `index` (an ALLREDUCE tied's `bucket`)."""
        for t in self.ties:
            if t.index == index:
                return t
        raise ProgramError(f"rank {self.rank} holds no copy of tied weight {index}")

    def count(self, op: str) -> int:
        return sum(1 for i in self.instrs if i.op == op)

    def __str__(self) -> str:
        head = (f"# rank {self.rank} of {self.world_size}  mesh "
                + " x ".join(f"{a} {s}" for a, s in self.mesh)
                + "  coords " + " ".join(f"{a}={c}" for (a, _), c in zip(self.mesh, self.coords))
                + f"  stages {list(self.stages)}  micro-batches {self.num_micro_batches} x {self.micro_batch_size}"
                + (f"  ZeRO {self.zero}" if self.zero else "")
                + "".join(f"\n# {p.describe(self.rank)}" for p in self.parts))
        return "\n".join([head, *(str(i) for i in self.instrs)])

    # ---- JSON -----------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "rank": self.rank, "world_size": self.world_size,
            "mesh": [[a, s] for a, s in self.mesh], "coords": list(self.coords),
            "stages": list(self.stages), "num_stages": self.num_stages,
            "num_micro_batches": self.num_micro_batches, "micro_batch_size": self.micro_batch_size,
            "zero": self.zero,
            "buckets": [{"stage": b.stage, "params": list(b.params), "numel": b.numel, "nbytes": b.nbytes,
                         **({} if b.decay else {"decay": False})} for b in self.buckets],
            "instrs": [i.to_dict() for i in self.instrs],
            **({"ties": [t.to_dict() for t in self.ties]} if self.ties else {}),
            **{p.key: p.to_dict() for p in self.parts},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "Program":
        """Raises ProgramError naming the field when the document is malformed (runtime/program/check.py)."""
        check_program_dict(d, axis_group)
        version = d.get("format_version")
        if version != PROGRAM_FORMAT_VERSION:
            raise ProgramError(f"Program format_version {version!r} is not supported "
                               f"(this runtime reads {PROGRAM_FORMAT_VERSION}); generate the build again")
        try:
            return cls(
                rank=int(d["rank"]), world_size=int(d["world_size"]),
                mesh=tuple((current_axis_name(a), int(s)) for a, s in d["mesh"]), coords=tuple(d["coords"]),
                stages=tuple(int(s) for s in d["stages"]), num_stages=int(d["num_stages"]),
                num_micro_batches=int(d["num_micro_batches"]), micro_batch_size=int(d["micro_batch_size"]),
                zero=int(d.get("zero", 0)),
                buckets=tuple(Bucket(int(b["stage"]), tuple(b["params"]), int(b["numel"]), int(b["nbytes"]),
                                     bool(b.get("decay", True))) for b in d.get("buckets", ())),
                instrs=tuple(Instr.from_dict(i) for i in d["instrs"]),
                ties=tuple(Tie.from_dict(t) for t in d.get("ties", ())),
                parts=tuple(k.from_dict(d[k.key]) for k in PARTS if k.key in d),
                format_version=version,
            )
        except KeyError as e:
            raise ProgramError(f"Program field {e.args[0]!r} is missing") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Program":
        return cls.from_dict(parse_document(text, "a Program file", error=_unreadable))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Program":
        return cls.from_dict(read_document(path, "Program file", error=_unreadable))


# ---- groups of the derived axes; the mesh layout itself is runtime/program/mesh.py -------------


def axis_group(mesh: Iterable[tuple[str, int]], coords: Iterable[int], axis: str) -> tuple[int, ...]:
    """Global ranks that differ from `coords` only on `axis`, in coordinate order."""
    mesh = tuple(mesh)
    coords = list(coords)
    names = [a for a, _ in mesh]
    if axis == PAIR_AXIS and axis not in names and MeshAxis.PIPELINE in names:
        return _pair_group(mesh, coords)
    if axis.startswith(TIE_AXIS) and MeshAxis.PIPELINE in names:
        return _tie_group(mesh, coords, axis)
    if axis not in names:
        raise ProgramError(f"unknown mesh axis {axis!r}; the mesh has {names}")
    return group_along(mesh, coords, axis)


def _pair_group(mesh: tuple[tuple[str, int], ...], coords: list[int]) -> tuple[int, ...]:
    """GEMS pair group: pipeline positions i and p-1-i, every data coordinate, sorted ranks."""
    names = [a for a, _ in mesh]
    kp = names.index(MeshAxis.PIPELINE)
    p = mesh[kp][1]
    out = set()
    for pos in {coords[kp], p - 1 - coords[kp]}:
        c = list(coords)
        c[kp] = pos
        out.update(axis_group(mesh, c, MeshAxis.DATA) if MeshAxis.DATA in names else (rank_of(mesh, c),))
    return tuple(sorted(out))


def tie_axis(positions) -> str:
    """The derived axis of the pipeline positions holding a tied weight's copies."""
    return TIE_AXIS + ",".join(str(p) for p in sorted(set(positions)))


def _tie_group(mesh: tuple[tuple[str, int], ...], coords: list[int], axis: str) -> tuple[int, ...]:
    """Ranks at the pipeline positions an axis "tie:I,J,..." names, other coordinates as `coords`."""
    names = [a for a, _ in mesh]
    kp = names.index(MeshAxis.PIPELINE)
    try:
        positions = sorted({int(x) for x in axis[len(TIE_AXIS):].split(",")})
    except ValueError:
        raise ProgramError(f"axis {axis!r} must name pipeline positions, as 'tie:0,3'") from None
    out = []
    for pos in positions:
        c = list(coords)
        c[kp] = pos
        out.append(rank_of(mesh, c))
    return tuple(out)


def all_axis_groups(mesh: Iterable[tuple[str, int]], axis: str) -> tuple[tuple[int, ...], ...]:
    """Every group along `axis`, sorted by first rank."""
    mesh = tuple(mesh)
    world = math.prod(s for _, s in mesh)
    seen: dict[tuple[int, ...], None] = {}
    for r in range(world):
        seen.setdefault(axis_group(mesh, coords_of(mesh, r), axis), None)
    return tuple(sorted(seen))


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{int(x)} B"
