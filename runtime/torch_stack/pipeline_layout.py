"""`PipelineLayout`: a plan's pipeline as torch.distributed.pipelining runs it, as plain data.

codegen/torch_target/pipeline.py derives it from a plan (meshplan's own partition of the captured
graph); runtime/torch_stack/pipeline.py builds this rank's stages from it. It round-trips through
JSON (`to_dict` / `from_dict`), so a script or a saved layout carries it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.spec import StageSpec
from runtime.vocab import Schedule


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage (a chunk under the interleaved schedule).

    position: the place on the pipeline axis that runs it (stage k runs at k % pipeline).
    spec: its inputs (one micro-batch's shapes; "recv" from the previous stage, "data" the
        model's inputs by name), the model modules and tensors its code reads, its tied weights.
    class_name / source: its class as torch's schedule calls it (`forward(*received, **inputs)`),
        a subclass of the partition's `Stage<k>` class, whose source comes first in `source`.
    """

    position: int
    spec: StageSpec
    class_name: str
    source: str

    @property
    def index(self) -> int:
        return self.spec.index

    def to_dict(self) -> dict:
        return {"position": self.position, "spec": self.spec.to_dict(), "class_name": self.class_name,
                "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "StageLayout":
        return cls(position=int(d["position"]), spec=StageSpec.from_dict(d["spec"]), class_name=str(d["class_name"]),
                   source=str(d["source"]))


@dataclass(frozen=True)
class PipelineLayout:
    """A plan's pipeline: `pipeline` positions, `virtual_stages` chunks each, `num_micro_batches`
    micro-batches of `micro_batch_size` samples per data rank and step, run by `schedule`.

    inputs: the model's input names (forward's parameters the graph reads), in forward's order.
    imports: the import lines the stage classes' source needs.
    """

    schedule: Schedule
    pipeline: int
    virtual_stages: int
    num_micro_batches: int
    micro_batch_size: int
    inputs: tuple[str, ...]
    imports: tuple[str, ...]
    stages: tuple[StageLayout, ...]

    @property
    def num_stages(self) -> int:
        return self.pipeline * self.virtual_stages

    def stages_at(self, position: int) -> tuple[StageLayout, ...]:
        """The stages pipeline position `position` runs, in stage order."""
        return tuple(s for s in self.stages if s.position == position)

    def source(self) -> str:
        """Python source defining every stage class (imports first)."""
        return "\n".join(self.imports) + "\n\n\n" + "\n\n".join(s.source for s in self.stages)

    def to_dict(self) -> dict:
        return {"schedule": self.schedule.value, "pipeline": self.pipeline, "virtual_stages": self.virtual_stages,
                "num_micro_batches": self.num_micro_batches, "micro_batch_size": self.micro_batch_size,
                "inputs": list(self.inputs), "imports": list(self.imports),
                "stages": [s.to_dict() for s in self.stages]}

    @classmethod
    def from_dict(cls, d: dict) -> "PipelineLayout":
        return cls(schedule=Schedule(d["schedule"]), pipeline=int(d["pipeline"]),
                   virtual_stages=int(d["virtual_stages"]), num_micro_batches=int(d["num_micro_batches"]),
                   micro_batch_size=int(d["micro_batch_size"]), inputs=tuple(str(x) for x in d["inputs"]),
                   imports=tuple(str(x) for x in d["imports"]),
                   stages=tuple(StageLayout.from_dict(s) for s in d["stages"]))


__all__ = ["PipelineLayout", "StageLayout"]
