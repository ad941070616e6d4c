"""The torch layout's records (codegen/torch_target/layout.py says what each choice means): frozen, with a
JSON round trip; the apply side (runtime/torch_stack) reads their `to_dict()`."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.torch_stack.pipeline_layout import PipelineLayout
from runtime.torch_stack.vocab import DataKind, TensorStyle   # the styles' enums, for codegen outside torch_target too
from runtime.vocab import MeshAxis, RecomputeMode


class TorchLayoutError(ValueError):
    """A plan the torch target cannot express; the message names the axis or module and what to do."""


@dataclass(frozen=True)
class MeshDim:
    """One dimension of the DeviceMesh: its axis name and size (devices)."""

    axis: MeshAxis
    size: int


@dataclass(frozen=True)
class ModuleStyle:
    """The tensor-parallel style of the module at `path`.

    groups: for COLWISE_STRIDED, the equal parts of the output features each split into t blocks
        (3 for a fused qkv), else 1.
    dim: under sequence parallelism, the sequence dimension split at a column's input (the columns of a
        region; BERT's decoder, after the head gathered the sequence, has None), at a row's or vocabulary
        embedding's output, at a SEQUENCE_SCATTER module's output or a SEQUENCE_GATHER module's input;
        else None.
    """

    path: str
    style: TensorStyle
    groups: int = 1
    dim: int | None = None


@dataclass(frozen=True)
class DataLayout:
    """Data parallelism: the wrapper, whether fully_shard frees gathered parameters after forward, and
    the module paths wrapped one by one before the root (the plan's blocks, in model order)."""

    kind: DataKind
    reshard_after_forward: bool = True
    units: tuple[str, ...] = ()


@dataclass(frozen=True)
class TorchLayout:
    """A plan in torch's vocabulary (see the module docstring).

    mesh: the DeviceMesh dimensions, outermost first (ranks row-major, last dimension fastest, as
        meshplan lays them out: runtime/program/mesh.py).
    tensor: the style of every tensor-parallel module, in graph order.
    sequence_dim: the activations' sequence dimension under sequence parallelism, else None.
    data: the data-parallel wrapper.
    recompute: activation recomputation; `checkpoint_units` the module paths it wraps.
    ties: groups of parameter names that are one parameter (tied embeddings), canonical name first;
        the apply side ties them again after the styles replaced the parameters.
    pipeline: the pipeline layout (codegen/torch_target/pipeline.py) or None for plans without one.
    """

    mesh: tuple[MeshDim, ...]
    tensor: tuple[ModuleStyle, ...] = ()
    sequence_dim: int | None = None
    data: DataLayout = field(default_factory=lambda: DataLayout(DataKind.NONE))
    recompute: RecomputeMode = RecomputeMode.NONE
    checkpoint_units: tuple[str, ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()
    pipeline: PipelineLayout | None = None

    @property
    def world_size(self) -> int:
        out = 1
        for d in self.mesh:
            out *= d.size
        return out

    def style_of(self, path: str) -> ModuleStyle | None:
        """The style of the module at `path`, or None if it is not tensor-parallel."""
        return next((s for s in self.tensor if s.path == path), None)

    def to_dict(self) -> dict:
        return {
            "mesh": [[str(d.axis), d.size] for d in self.mesh],
            "tensor": [{"path": s.path, "style": str(s.style), "groups": s.groups, "dim": s.dim} for s in self.tensor],
            "sequence_dim": self.sequence_dim,
            "data": {"kind": str(self.data.kind), "reshard_after_forward": self.data.reshard_after_forward,
                     "units": list(self.data.units)},
            "recompute": str(self.recompute),
            "checkpoint_units": list(self.checkpoint_units),
            "ties": [list(t) for t in self.ties],
            "pipeline": None if self.pipeline is None else self.pipeline.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TorchLayout":
        pipeline = None
        if d.get("pipeline") is not None:
            pipeline = PipelineLayout.from_dict(d["pipeline"])
        data = d["data"]
        return cls(
            mesh=tuple(MeshDim(MeshAxis(a), int(n)) for a, n in d["mesh"]),
            tensor=tuple(ModuleStyle(s["path"], TensorStyle(s["style"]), int(s["groups"]),
                                     None if s["dim"] is None else int(s["dim"])) for s in d["tensor"]),
            sequence_dim=None if d["sequence_dim"] is None else int(d["sequence_dim"]),
            data=DataLayout(DataKind(data["kind"]), bool(data["reshard_after_forward"]), tuple(data["units"])),
            recompute=RecomputeMode(d["recompute"]),
            checkpoint_units=tuple(d["checkpoint_units"]),
            ties=tuple(tuple(t) for t in d["ties"]),
            pipeline=pipeline,
        )


__all__ = ["DataKind", "DataLayout", "MeshDim", "ModuleStyle", "TensorStyle", "TorchLayout", "TorchLayoutError"]
