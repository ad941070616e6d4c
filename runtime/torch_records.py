"""What a torch build (codegen/torch_target) writes that meshplan's own launcher and verify read too:
rank 0's whole-model record (`whole_model_view`) and a torch checkpoint's record (`TorchCheckpoint`,
and the checkpoint `--resume` names: `resolve`).

meshplan's runtime never imports the torch target's modules (runtime/torch_script*.py,
runtime/torch_stack/; tests/unit/test_import_directions.py checks it): both sides read these records
from here. The layout of a torch checkpoint is described in runtime/torch_script_checkpoint.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.checkpoint import MANIFEST, TORCH_INFO, TORCH_LATEST, CheckpointError, complete_checkpoints
from runtime.program import Program
from runtime.spec import StageSpec

FORMAT_VERSION = 1   # records without "files" (saved before digests were kept) are read, not digest-checked
# build.json of a torch build: {"micro_batch_size": ..., "micro_batches": ...} of a data rank; verify
# reads the run's records as those of a one-stage build whose rank 0 holds the whole model
WHOLE_MODEL_KEY = "whole_model"


@dataclass(frozen=True)
class TorchCheckpoint:
    """Rank 0's record of a complete torch checkpoint. step: the next step to run; samples: samples
    consumed (step x global batch); run_id: the run that saved it (runtime/checkpoint/run_ids.py)."""

    step: int
    samples: int
    run_id: str
    model_ref: str
    format: int = FORMAT_VERSION
    files: dict = field(default_factory=dict)   # file name -> {"sha256", "bytes"} (runtime/torch_stack/dcp.py)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TorchCheckpoint":
        files = {str(k): {"sha256": str(v["sha256"]), "bytes": int(v["bytes"])} for k, v in d.get("files", {}).items()}
        return cls(int(d["step"]), int(d["samples"]), str(d["run_id"]), str(d["model_ref"]), int(d["format"]), files)

    @classmethod
    def load(cls, ckpt: Path) -> "TorchCheckpoint":
        path = Path(ckpt) / TORCH_INFO
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except OSError as e:
            raise CheckpointError(f"checkpoint record {path} cannot be read ({e.strerror or e})") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"checkpoint record {path} is damaged ({type(e).__name__}: {e}); resume from "
                                  "another checkpoint") from None


def refuse_meshplan(p: Path, flag: str) -> None:
    """CheckpointError when `p` is (or holds) a checkpoint of meshplan's own runtime."""
    if (p / MANIFEST).is_file() or complete_checkpoints(p):
        raise CheckpointError(
            f"{flag} {p} is a checkpoint of meshplan's own runtime (rank files and {MANIFEST}); a torch build "
            "reads and writes Distributed Checkpoints only: resume it with the meshplan build of the plan "
            "(meshplan codegen without --target torch), or give this torch build another directory")


def resolve(path: str | os.PathLike) -> Path:
    """The torch checkpoint `--resume path` names: `path` itself if complete, else ROOT/latest's."""
    p = Path(path)
    refuse_meshplan(p, "--resume")
    if (p / TORCH_INFO).is_file():
        return p
    latest = p / TORCH_LATEST
    if latest.is_file():
        return p / latest.read_text().strip()
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} does not exist; give a step directory or the --checkpoint-dir "
                              "of an earlier run of a torch build")
    raise CheckpointError(f"{p} holds no complete torch checkpoint (no {TORCH_INFO} nor {TORCH_LATEST}: a save "
                          "that was interrupted, or another directory); run with --checkpoint-dir to make one")


def whole_model_spec() -> StageSpec:
    """The one stage of the whole-model view: the whole model, nothing split."""
    return StageSpec(index=0, layers=(), inputs=(), outputs=(), modules=(), is_last=True)


def whole_model_view(info: dict) -> tuple[dict[int, Program], dict[int, StageSpec]]:
    """(programs, stage specs) through which runtime/verify/__init__.py reads a torch build's records: rank 0
    of the plan's mesh holding the whole model as one stage, with a data rank's micro-batches."""
    view = info[WHOLE_MODEL_KEY]
    mesh = tuple((str(a), int(s)) for a, s in info["mesh"].items())
    program = Program(rank=0, world_size=int(info["world_size"]), mesh=mesh, coords=(0,) * len(mesh), stages=(0,),
                      num_stages=1, num_micro_batches=int(view["micro_batches"]),
                      micro_batch_size=int(view["micro_batch_size"]), instrs=())
    return {0: program}, {0: whole_model_spec()}
