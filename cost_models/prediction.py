"""`Prediction`: what the cost model says one training step costs.

Times are seconds per step; memory is bytes per device; rates are per
second. The time breakdown adds up to `step_time`; the memory breakdown adds
up to `peak_memory` (the device with the largest footprint decides).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds per step on the critical path, adding up to the step time."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    tensor_comm: float = 0.0      # tensor-parallel collectives inside forward/backward
    pipeline_comm: float = 0.0    # point-to-point sends of activations and gradients
    bubble: float = 0.0           # pipeline fill and drain
    data_comm: float = 0.0        # data-parallel gradient sync left exposed after overlap
    zero_comm: float = 0.0        # ZeRO parameter gathers / gradient reduce-scatters on the critical path
    optimizer: float = 0.0        # the step's end: optimizer step, gradient norm, zeroing; waits at syncs (GPU)
    loss: float = 0.0             # the loss on the last stage, forward and backward (GPU)
    host: float = 0.0             # seconds the device waits for the host to dispatch its kernels (GPU)

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes held by one device at its peak, adding up to `total`."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    comm_buffers: float = 0.0
    temporary: float = 0.0
    fragmentation: float = 0.0   # reserved by the caching allocator beyond the rest (a stated margin)
    weight_copies: float = 0.0   # the 16-bit weight copies autocast keeps for backward, per micro-batch in flight
    loss: float = 0.0            # the loss's buffers at its peak beyond what its forward kept (GPU)

    @property
    def total(self) -> float:
        """Bytes reserved at the peak: what is allocated plus the allocator's fragmentation margin."""
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))

    @property
    def allocated(self) -> float:
        """Bytes allocated at the peak (torch.cuda.max_memory_allocated's figure): the total without the
        fragmentation margin."""
        return self.total - self.fragmentation


@dataclass(frozen=True)
class StagePrediction:
    """One pipeline stage: its layers, time per micro-batch and memory per device."""

    index: int
    first_layer: str
    last_layer: str
    num_layers: int
    forward: float                # s per micro-batch, including tensor-parallel collectives
    backward: float               # s per micro-batch, including recompute and collectives
    memory: MemoryBreakdown
    host_forward: float = 0.0     # GPU: host s dispatching one micro-batch's forward / backward
    host_backward: float = 0.0


@dataclass(frozen=True)
class Prediction:
    step_time: float
    time: TimeBreakdown
    peak_memory: float
    memory: MemoryBreakdown       # of the device with the largest footprint
    memory_capacity: float        # bytes per device
    fits: bool
    samples_per_s: float
    tokens_per_s: float | None    # None for models whose inputs are not token ids
    model_flops_per_device: float  # FLOP/s of useful model work (3x forward, no recompute)
    mfu: float                    # model_flops_per_device / peak FLOP/s of the compute dtype
    num_micro_batches: int
    stages: tuple[StagePrediction, ...]
    step_energy: float = 0.0      # joules per step over all devices (busy x active W + idle x idle W)

    @property
    def allocated_memory(self) -> float:
        """Bytes allocated at the peak on the fullest device: what a measurement of allocated memory
        (torch.cuda.max_memory_allocated) is compared with; `peak_memory` adds the fragmentation margin."""
        return self.memory.allocated

    @property
    def bubble_fraction(self) -> float:
        return self.time.bubble / self.step_time if self.step_time else 0.0

    def summary(self) -> str:
        t, m = self.time, self.memory
        gib = 2**30
        lines = [
            f"step {self.step_time * 1e3:,.1f} ms   {self.samples_per_s:,.2f} samples/s"
            + (f"   {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else "")
            + f"   MFU {self.mfu:.1%}   {self.step_energy:,.1f} J/step",
            "time: " + ", ".join(f"{f.name} {getattr(t, f.name) * 1e3:,.1f} ms"
                                 for f in dataclasses.fields(t) if getattr(t, f.name) > 0),
            f"peak memory {self.allocated_memory / gib:,.2f} GiB allocated, {self.peak_memory / gib:,.2f} GiB "
            f"reserved of {self.memory_capacity / gib:,.0f} GiB ({'fits' if self.fits else 'DOES NOT FIT'}): "
            + ", ".join(f"{f.name} {getattr(m, f.name) / gib:,.2f}" for f in dataclasses.fields(m)
                        if getattr(m, f.name) > 0),
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Prediction":
        d = dict(d)
        d["time"] = TimeBreakdown(**d["time"])
        d["memory"] = MemoryBreakdown(**d["memory"])
        d["stages"] = tuple(StagePrediction(**{**s, "memory": MemoryBreakdown(**s["memory"])})
                            for s in d["stages"])
        return cls(**d)
