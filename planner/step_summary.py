"""How the Evaluator turns a priced step into its Prediction: each stage's forward and backward per
micro-batch, samples and tokens per second, model FLOPs and MFU, and the energy of a step.

`StepSummary` is the part of planner/evaluator.py's Evaluator that does this, kept apart so each file
holds one concern; the placements (planner/strategies/pipeline, bidirectional) call its `prediction`
once they have priced the step. It reads the Evaluator's graph, cluster, tokens_per_sample and
_fwd_flops_per_sample.
"""

from __future__ import annotations

from cost_models.prediction import MemoryBreakdown, Prediction, StagePrediction, TimeBreakdown
from planner.config import ParallelConfig
from planner.graph.model import ModelGraph
from planner.layer_cost import LayerCost
from runtime.vocab import OpKind


class StepSummary:
    """The Evaluator's Prediction of a priced step (see module docstring)."""

    def prediction(self, config: ParallelConfig, global_batch_size: int, m: int, costs: list[LayerCost],
                    stages: list, time: TimeBreakdown, peak_mem: MemoryBreakdown, busy: float) -> Prediction:
        """Assemble a Prediction from the step's time breakdown and the largest device footprint."""
        dev = self.cluster.device
        step = time.total
        samples = global_batch_size / step
        model_flops = 3 * self._fwd_flops_per_sample * samples / config.num_devices
        peak_flops = dev.peak(config.dtype)
        # a stage's forward and backward per micro-batch: its device time, or on a GPU the host's dispatching
        # its kernels where that is longer (the simulator runs the instructions with these times)
        stage_preds = tuple(
            StagePrediction(
                index=k, first_layer=self.graph.layers[lo].name, last_layer=self.graph.layers[hi - 1].name,
                num_layers=hi - lo,
                forward=max(sum(c.forward + c.comm_forward for c in costs[lo:hi]),
                            sum(c.host_forward for c in costs[lo:hi])),
                backward=max(sum(c.backward + c.recompute + c.comm_backward for c in costs[lo:hi]),
                             sum(c.host_backward for c in costs[lo:hi])),
                memory=mem,
                host_forward=sum(c.host_forward for c in costs[lo:hi]),
                host_backward=sum(c.host_backward for c in costs[lo:hi]),
            )
            for k, (lo, hi, _i, mem) in enumerate(sorted(stages, key=lambda s: s[0]))
        )
        return Prediction(
            step_time=step, time=time, peak_memory=peak_mem.total, memory=peak_mem,
            memory_capacity=float(dev.memory_bytes), fits=peak_mem.total <= dev.memory_bytes,
            samples_per_s=samples,
            tokens_per_s=samples * self.tokens_per_sample if self.tokens_per_sample else None,
            model_flops_per_device=model_flops, mfu=model_flops / peak_flops,
            num_micro_batches=m, stages=stage_preds,
            step_energy=self._energy(step, busy, config.num_devices),
        )

    def _energy(self, step: float, busy: float, devices: int) -> float:
        """Joules per step: every device busy for `busy` s at active power, idle the rest."""
        dev = self.cluster.device
        busy = min(busy, step)
        return devices * (busy * dev.active_watts + (step - busy) * dev.idle_watts)


def input_tokens_per_sample(graph: ModelGraph) -> int | None:
    """Sequence length when the model's first input is token ids, else None."""
    for n in graph.nodes:
        if n.kind == OpKind.INPUT and n.output_meta:
            m = n.output_meta[0]
            if m.dtype.startswith(("int", "uint")) and len(m.shape) >= 2:
                return m.numel // graph.batch_size
            return None
    return None


__all__ = ["StepSummary", "input_tokens_per_sample"]
