"""Which execution options a plan runs with (runtime/execution.py): priced by the Evaluator, chosen where
they pay.

On a GPU, meshplan's runtime can compile each stage's repeated blocks, compile the loss over whole
logits, compute the loss in chunks fused with the output layer, and pad the output layer's rows to a
multiple of 64. The cost model prices each (planner/node_pricing.py and execution_pricing.py: compiled
layers fuse their casts and dispatch from generated code; the compiled loss reads the logits in their
dtype and keeps no fp32 copy of them; the fused loss runs the head's GEMMs itself and never holds the
logits; a padded vocabulary prices the output GEMM at its aligned width), so the plan takes the
combination with the best objective that fits, the defaults on a tie. Where an option does not apply
nothing is tried: on a CPU (the CPU cost model does not price compilation), for the torch target
(PyTorch's stack runs its own loop), for strategies whose stages the runtime does not compile (spatial,
sub-graph and context parallelism; codegen/emit.check_execution), for a loss other than cross-entropy,
for the fused loss a model whose output is not a linear layer's, and for the compiled loss logits
split over the vocabulary.
"""

from __future__ import annotations

from runtime.execution import Execution, LossImpl
from runtime.vocab import ShardRole

# the output layer's rows are padded to a multiple of this where the vocabulary is not one already
# (the misaligned kernels run at a tenth of the aligned rate: cost_models/gpu_costs.py gemm_misaligned)
VOCAB_MULTIPLE = 64


def candidates(ev, config) -> list[Execution]:
    """The execution options worth pricing for `config` on `ev`'s cluster and graph (the defaults first)."""
    if ev.gpu_costs is None or not ev.overlap.autocast or ev.overlap.param_gather:
        return [Execution()]   # a CPU, or a stack other than meshplan's runtime (the torch target's FSDP)
    if not all(s.compiles for s in ev.active(config)):   # tiles, paths or sequence chunks inside the layers
        return [Execution()]
    head = ev.fused_head_candidate()
    pad = VOCAB_MULTIPLE if head is not None and _vocab(ev, head) % VOCAB_MULTIPLE and _pads(ev, config, head) else 1
    cross_entropy = ev.setup.loss == "cross_entropy"
    losses = [LossImpl.FULL] + ([LossImpl.COMPILED] if cross_entropy and _whole_logits(ev, config) else []) \
        + ([LossImpl.CHUNKED] if head is not None and cross_entropy else [])
    return [Execution(compile=c, loss=loss, vocab_multiple=pad) for c in (False, True) for loss in losses]


def _whole_logits(ev, config) -> bool:
    """Whether each rank holding the logits holds all their classes (the compiled loss's condition:
    codegen/emit.check_loss_split refuses it where the output layer is split over the vocabulary)."""
    name = ev.logits_node()
    if name is None:
        return False
    role = ev.node_roles(config).get(name, ShardRole.REPLICATE)
    return ev.split_divisor(name, role, config) == 1


def _vocab(ev, head: str) -> int:
    meta = ev.node(head).output_meta[0]
    return meta.shape[-1] if meta.shape else 1


def _pads(ev, config, head: str) -> bool:
    """Whether the runtime can pad the output layer under `config`: whole on the rank, or split over the
    vocabulary by the tensor axis (codegen/partition.py refuses a padding nothing splits)."""
    return ev.split_ranks(config) == 1 or ev.node_roles(config).get(head, ShardRole.REPLICATE) != ShardRole.REPLICATE


def choose(ev, config, global_batch_size: int, objective: str = "time", fits=None):
    """(the Evaluator with the best execution options for `config`, its Prediction): the candidates' fastest
    (or, for objective "energy", least energy) that fits (`fits(prediction)`, default Prediction.fits), the
    earlier candidate on a tie. `ev` itself prices the first candidate, the defaults."""
    fits = fits or (lambda pred: pred.fits)
    best_ev, best = ev, ev.evaluate(config, global_batch_size)
    for ex in candidates(ev, config)[1:]:
        other = ev.with_execution(ex)
        pred = other.evaluate(config, global_batch_size)
        if fits(pred) and (not fits(best) or _score(pred, objective) < _score(best, objective) * (1 - 1e-9)):
            best_ev, best = other, pred
    return best_ev, best


def _score(pred, objective: str) -> float:
    return pred.step_energy if objective == "energy" else pred.step_time
