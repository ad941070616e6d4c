"""What `meshplan compare` and `meshplan simulate` predict a build's step from: the build's plan priced on a
cluster (`predicted_costs`: the plan's configuration with its stage boundaries pinned, its tensor-parallel
layout, the optimizer the build trains with), corrected for what meshplan's runtime does (`for_runtime`),
and the compute costs the simulator (cost_models/simulate.py) runs the build's Programs with.

Reading a build never imports the model's code: what the prediction needs from the model is the
captured graph the build was generated from (build/graph.json).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from codegen.emit import GRAPH_FILE
from cost_models.calibration.calibrate import for_world
from cost_models.calibrated import calibrated_efficiency, optimizer_per_step, optimizer_per_tensor
from cost_models.compute import Efficiency
from cost_models.hardware import Cluster
from cost_models.memory import param_bytes
from cost_models.simulate import ComputeCosts
from cost_models.step_costs import StepSetup
from planner.evaluator import Evaluator
from planner.strategies.data.strategy import GRAD_BUCKET_BYTES
from planner.graph.model import ModelGraph
from planner.plan import Plan, PlanFileError
from runtime.launch.build_files import REMAKE, BuildError, read_build, read_build_file
from runtime.execution import Execution
from runtime.program.instr_set import Kind
from runtime.program import COLLECTIVE_OPS, Program
from runtime.spec import computes_grad_norm
from runtime.vocab import DeviceKind, DType, OpKind, ShardRole

# Optimizer state bytes per parameter (fp32 state) for what the runtime builds (runtime/execute/optim.py),
# and bytes one step moves per parameter (fp32): SGD reads weight and gradient and writes the
# weight; momentum adds its buffer's read and write; AdamW reads weight, gradient and two
# moments and writes weight and moments.
_STATE_PER_PARAM = {"sgd": 0.0, "sgd_momentum": 4.0, "adamw": 8.0}
_STEP_BYTES_PER_PARAM = {"sgd": 12.0, "sgd_momentum": 20.0, "adamw": 28.0}


class CompareError(ValueError):
    """A build that cannot be compared (not run, not traced); the message says what to do."""


def _load_json(path: Path, what: str, fix: str):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CompareError(f"{path} is missing ({what}); {fix}") from None
    except (OSError, ValueError) as e:
        raise CompareError(f"{path} cannot be read ({e}); {fix}") from None


def build_graph(build: Path, plan) -> "ModelGraph":
    """The captured graph a build was generated from (its graph.json), checked against its plan;
    read as data, so no code of the model runs."""
    path = build / GRAPH_FILE
    fix = f"generate the build again with `meshplan codegen ... -o {build}`"
    data = _load_json(path, "the model's captured graph, which builds made before meshplan wrote it lack", fix)
    try:
        graph = ModelGraph.from_dict(data)
    except (KeyError, TypeError, ValueError) as e:
        raise CompareError(f"{path} cannot be read ({e}); {fix}") from None
    if graph.fingerprint != plan.graph_fingerprint:
        raise CompareError(f"{path} is the graph of another model (fingerprint {graph.fingerprint[:12]}, the plan "
                           f"is bound to {plan.graph_fingerprint[:12]}); {fix}")
    return graph


def predicted_costs(build: str | Path, cluster: "Cluster"):
    """(plan priced on `cluster`, its Prediction, ComputeCosts, Programs) for the build's configuration."""
    build = Path(build)
    info = read_build(build)
    try:
        plan = Plan.from_dict(read_build_file(build, "plan.json", "plan file"), origin=str(build / "plan.json"))
    except PlanFileError as e:
        raise BuildError(f"{e}; {REMAKE}") from None
    progs = {int(r): Program.from_dict(d) for r, d in
             read_build_file(build, "programs.json", "per-rank Programs file").items()}
    world = len(progs)
    cluster = for_world(cluster, world)
    train = info["train"]
    graph = build_graph(build, plan)
    bounds = tuple(st.layers[0] for st in plan.stages[1:])
    config = dataclasses.replace(plan.config, stage_boundaries=bounds or None)
    mode = "all" if plan.split_ranks > 1 and \
        Evaluator(graph, cluster, sharding="all").node_roles(config) == dict(plan.shardings) else "ilp"
    gpu = cluster.device.kind == DeviceKind.GPU
    # on a GPU the Evaluator prices the build's own step (its optimizer and implementation, clipping, loss
    # and execution options) as the runtime runs it; on a CPU the calibrated fixed costs are added below
    options = dict(setup=setup_of(train), execution=recorded_execution(train)) if gpu else {}
    pred = Evaluator(graph, cluster, sharding=mode, **options).evaluate(config, plan.global_batch_size)
    tensors = param_tensors(graph, plan)
    if not gpu:
        pred = for_runtime(pred, plan.config, train.get("optimizer") or {}, cluster, largest_weights(graph, plan),
                           tensors)
    grad_bytes = max((s.memory.gradients for s in pred.stages), default=0.0)
    costs = ComputeCosts.from_prediction(pred, cluster, loss_elements=loss_elements(graph, plan),
                                         vocab_split=vocab_split(graph, plan), grad_tensors=tensors,
                                         grad_bytes=grad_bytes,
                                         reduced_grad_bytes=grad_bytes if reduces_grads(progs) else 0.0)
    return dataclasses.replace(plan, cluster=cluster, prediction=pred), pred, costs, progs, cluster


def setup_of(train: dict) -> StepSetup:
    """The StepSetup (cost_models/step_costs.py) of a build's training description (build.json "train")."""
    opt = train.get("optimizer") or {}
    name = opt.get("name", "sgd")
    return StepSetup(optimizer=name if name in ("adamw", "sgd") else "adamw", optimizer_impl=opt.get("impl", "auto"),
                     clip_grad=train.get("clip_grad") is not None,
                     loss=train.get("loss", "cross_entropy"),
                     grad_norm=computes_grad_norm(bool(train.get("grad_norm", True)), train.get("clip_grad"),
                                                  train.get("loss_scale") is not None))


def recorded_execution(train: dict) -> Execution:
    """The Execution options (runtime/execution.py) a build's training description records (defaults if none)."""
    doc = train.get("execution")
    return Execution.from_dict(doc, "build.json train.execution") if doc else Execution()


def loss_elements(graph, plan) -> float:
    """Logits elements per micro-batch that one last-stage rank computes the loss over (the
    model output; split by the tensor degree when its last op is split by class, vocabulary-parallel)."""
    out = next((n for n in graph.nodes if n.kind == OpKind.OUTPUT), None)
    if out is None or not out.input_meta:
        return 0.0
    return out.input_meta[0].numel / (plan.split_ranks if vocab_split(graph, plan) else 1)


def reduces_grads(progs: dict) -> bool:
    """Whether any rank all-reduces (or reduce-scatters) gradients with other ranks in a step."""
    return any(ins.op in COLLECTIVE_OPS and ins.kind == Kind.GRADS and len(p.group(ins.axis)) > 1
               for p in progs.values() for ins in p.instrs)


def vocab_split(graph, plan) -> tuple[float, int] | None:
    """(rows of logits per micro-batch, tensor degree) when the model output's last op is split
    by class over the tensor axis (role "column_out": the runtime computes a vocabulary-parallel
    loss on it), else None."""
    out = next((n for n in graph.nodes if n.kind == OpKind.OUTPUT), None)
    if out is None or not out.input_meta or not out.inputs or plan.split_ranks < 2 or \
            dict(plan.shardings).get(out.inputs[0]) not in (ShardRole.COLUMN, ShardRole.COLUMN_OUT):
        return None
    logits = out.input_meta[0]
    return logits.numel / max(logits.shape[-1], 1), plan.split_ranks


def largest_weights(graph, plan) -> dict[int, float]:
    """Stage index -> bytes of its largest parameter tensor on one rank (fp32; a node's
    parameters, split by the tensor degree where the plan shards the node)."""
    nodes = {n.name: n for n in graph.nodes}
    layers = {layer.name: layer for layer in graph.layers}
    sharded = dict(plan.shardings)
    t = plan.split_ranks
    out = {}
    for st in plan.stages:
        sizes = [nodes[name].param_count * 4 / (t if name in sharded else 1)
                 for lname in st.layers for name in layers[lname].nodes]
        out[st.index] = max(sizes, default=0.0)
    return out


def param_tensors(graph, plan) -> int:
    """Parameter tensors of the stage with the most (each rank steps its stage's tensors one by one)."""
    nodes = {n.name: n for n in graph.nodes}
    layers = {layer.name: layer for layer in graph.layers}
    return max((sum(len(nodes[name].param_names) for lname in st.layers for name in layers[lname].nodes)
                for st in plan.stages), default=0)


def for_runtime(pred, config, optimizer: dict, cluster, largest_weight: dict[int, float] | None = None,
                param_tensors: int = 0):
    """The prediction for what meshplan's runtime does, not the planner's generic model:

    - the optimizer step's time from the bytes the build's optimizer moves (fp32, no ZeRO),
      plus, on a calibrated cluster, the measured fixed cost per parameter tensor times the
      `param_tensors` of the largest stage (the runtime steps one tensor at a time) and the
      fixed cost of the step call;

    - optimizer state of the optimizer the build trains with (SGD: none, with momentum:
      one fp32 buffer per parameter, AdamW: two), where the planner assumes Adam;
    - no copy of the gradients for the data-parallel sync: the runtime all-reduces its
      flat gradient buckets in place (the gradients are views into them), where the
      planner assumes DDP's two bucket-sized copies;
    - a weight's gradient is computed into a fresh tensor and then added into its bucket
      (or its .grad), so the largest weight of a stage is a temporary too.
    """
    name = optimizer.get("name", "sgd")
    key = "sgd_momentum" if name == "sgd" and optimizer.get("momentum", 0.0) else name
    per_param = _STATE_PER_PARAM.get(key)
    planned = param_bytes(config.dtype, config.zero, config.data).optimizer
    shard = config.data if config.zero >= 1 else 1

    def fix(mem):
        changes = {}
        if per_param is not None and planned:
            changes["optimizer"] = mem.optimizer / planned * per_param / shard
        if config.data > 1 and config.zero <= 1:
            changes["comm_buffers"] = max(mem.comm_buffers - 2 * min(GRAD_BUCKET_BYTES, mem.gradients), 0.0)
        return dataclasses.replace(mem, **changes)
    largest = largest_weight or {}
    stages = tuple(dataclasses.replace(s, memory=dataclasses.replace(
        fix(s.memory), temporary=max(s.memory.temporary, largest.get(s.index, 0.0)))) for s in pred.stages)
    time = pred.time
    if key in _STEP_BYTES_PER_PARAM and config.dtype == DType.FP32 and config.zero == 0:
        eff = calibrated_efficiency(cluster) or Efficiency.default_for(cluster.device)
        params = max(s.memory.parameters for s in pred.stages) / 4  # fp32 weights, unsharded
        step = params * _STEP_BYTES_PER_PARAM[key] / (cluster.device.memory_bandwidth * eff.memory) \
            + param_tensors * optimizer_per_tensor(cluster, key) + optimizer_per_step(cluster, key)
        time = dataclasses.replace(time, optimizer=step)
    return dataclasses.replace(pred, stages=stages, memory=fix(pred.memory), time=time,
                               peak_memory=max(s.memory.total for s in stages))
