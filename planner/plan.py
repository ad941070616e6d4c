"""`Plan`: the planner's answer, a frozen value that round-trips through JSON.

A plan is bound to the graph it was made for (`graph_fingerprint`) and names
everything by layer name or fx node name, never by position alone: stages
are lists of layer names, tensor-parallel roles are keyed by node name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_models.hardware import Cluster
from cost_models.prediction import Prediction
from planner.config import ParallelConfig

PLAN_FORMAT_VERSION = 1


class PlanFileError(ValueError):
    """A plan file that cannot be read; the message names the field and the file."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (a chunk, under the interleaved schedule).

    `device_index` is the position on the pipeline axis that runs it: stage
    k runs on pipeline position k % pipeline.
    """

    index: int
    device_index: int
    layers: tuple[str, ...]   # layer names, in model order


@dataclass(frozen=True)
class Alternative:
    """A configuration the search priced and did not choose, and why it lost."""

    config: ParallelConfig
    step_time: float          # s
    peak_memory: float        # bytes per device
    step_energy: float        # J per step
    fits: bool
    reason: str

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "step_time": self.step_time, "peak_memory": self.peak_memory,
                "step_energy": self.step_energy, "fits": self.fits, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict) -> "Alternative":
        return cls(config=ParallelConfig.from_dict(d["config"]), step_time=float(d["step_time"]),
                   peak_memory=float(d["peak_memory"]), step_energy=float(d["step_energy"]),
                   fits=bool(d["fits"]), reason=str(d["reason"]))


@dataclass(frozen=True)
class Plan:
    format_version: int
    model_class: str
    graph_fingerprint: str
    cluster: Cluster
    config: ParallelConfig
    global_batch_size: int
    stages: tuple[Stage, ...]
    shardings: tuple[tuple[str, str], ...]  # (fx node name, tensor-parallel role) for non-replicated nodes
    prediction: Prediction
    search: tuple[tuple[str, Any], ...] = ()  # how the plan was found: candidates evaluated, pruned, seconds
    alternatives: tuple[Alternative, ...] = ()  # the next best configurations, best first

    # ---- views ----------------------------------------------------------
    @property
    def mesh(self) -> dict[str, int]:
        return self.config.mesh

    def role(self, node: str) -> str:
        return dict(self.shardings).get(node, "replicate")

    def summary(self) -> str:
        """A readable table: mesh, stages, memory per stage, time breakdown."""
        c, p = self.config, self.prediction
        gib = 2**30
        lines = [
            f"Plan for {self.model_class} on {self.cluster.name} "
            f"({self.cluster.num_nodes} x {self.cluster.devices_per_node} = {self.cluster.num_devices} devices)",
            f"  mesh: " + " x ".join(f"{k} {v}" for k, v in self.mesh.items()) +
            f"   micro-batch {c.micro_batch_size} x {p.num_micro_batches}   schedule "
            + (f"bidirectional (GEMS, {c.replicas_per_direction} pair(s): device r runs stages r and p-1-r)"
               if c.bidirectional else c.schedule)
            + (f" (v={c.virtual_stages})" if c.schedule == "interleaved" else "")
            + f"   recompute {c.recompute}   ZeRO {c.zero}   {c.dtype}",
            f"  global batch {self.global_batch_size}: step {p.step_time:.4g} s, {p.samples_per_s:,.2f} samples/s"
            + (f", {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else "") + f", MFU {p.mfu:.1%}",
            "",
            f"  {'stage':>5} {'dev':>4} {'layers':>7}  {'first .. last':<38} {'fwd ms':>9} {'bwd ms':>9} {'mem GiB':>8}",
        ]
        for s, sp in zip(self.stages, p.stages):
            span = f"{s.layers[0]} .. {s.layers[-1]}" if len(s.layers) > 1 else s.layers[0]
            dev = f"{s.device_index}/{c.pipeline - 1 - s.device_index}" if c.bidirectional else str(s.device_index)
            lines.append(f"  {s.index:>5} {dev:>4} {len(s.layers):>7}  {span[:38]:<38} "
                         f"{sp.forward * 1e3:>9.3f} {sp.backward * 1e3:>9.3f} {sp.memory.total / gib:>8.3f}")
        lines += ["", "  time per step:"]
        total = p.step_time or 1.0
        for f in dataclasses.fields(p.time):
            v = getattr(p.time, f.name)
            if v > 0:
                lines.append(f"    {f.name:<14} {v * 1e3:>12.3f} ms  {v / total:>6.1%}")
        m = p.memory
        lines += ["", f"  memory per device (peak {p.peak_memory / gib:.2f} of {p.memory_capacity / gib:.0f} GiB):"]
        for f in dataclasses.fields(m):
            v = getattr(m, f.name)
            if v > 0:
                lines.append(f"    {f.name:<14} {v / gib:>12.3f} GiB")
        if self.search:
            lines += ["", "  search: " + ", ".join(f"{k} {v}" for k, v in self.search)]
        return "\n".join(lines)

    # ---- JSON -----------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "model_class": self.model_class,
            "graph_fingerprint": self.graph_fingerprint,
            "cluster": self.cluster.to_dict(),
            "config": self.config.to_dict(),
            "global_batch_size": self.global_batch_size,
            "stages": [{"index": s.index, "device_index": s.device_index, "layers": list(s.layers)}
                       for s in self.stages],
            "shardings": {k: v for k, v in self.shardings},
            "prediction": self.prediction.to_dict(),
            "search": {k: v for k, v in self.search},
            "alternatives": [a.to_dict() for a in self.alternatives],
        }

    @classmethod
    def from_dict(cls, d: dict, *, origin: str | None = None) -> "Plan":
        where = f"plan file {origin}" if origin else "plan"
        if not isinstance(d, dict):
            raise PlanFileError(f"{where}: expected a JSON object at the top level")
        version = d.get("format_version")
        if version != PLAN_FORMAT_VERSION:
            raise PlanFileError(f"{where}: field 'format_version' is {version!r}; this meshplan reads "
                                f"version {PLAN_FORMAT_VERSION}. Make the plan again with this version.")
        try:
            return cls(
                format_version=version,
                model_class=str(d["model_class"]),
                graph_fingerprint=str(d["graph_fingerprint"]),
                cluster=Cluster.from_dict(d["cluster"], origin=origin),
                config=ParallelConfig.from_dict(d["config"]),
                global_batch_size=int(d["global_batch_size"]),
                stages=tuple(Stage(int(s["index"]), int(s["device_index"]), tuple(s["layers"]))
                             for s in d["stages"]),
                shardings=tuple(sorted(d.get("shardings", {}).items())),
                prediction=Prediction.from_dict(d["prediction"]),
                search=tuple(d.get("search", {}).items()),
                alternatives=tuple(Alternative.from_dict(a) for a in d.get("alternatives", [])),
            )
        except KeyError as e:
            raise PlanFileError(f"{where}: field {e.args[0]!r} is missing; make the plan again") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, PlanFileError):
                raise
            raise PlanFileError(f"{where}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise PlanFileError(f"plan file {p} does not exist") from None
        except json.JSONDecodeError as e:
            raise PlanFileError(f"plan file {p} is not valid JSON: {e}") from None
        return cls.from_dict(data, origin=str(p))
