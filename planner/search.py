"""`planner.search`: the best plan for a model on a cluster, within the cost model (`planner.optimize`).

The search enumerates mesh shapes (data x pipeline x tensor, tensor inside a
node by default) with micro-batch sizes and schedules, orders them by a
lower bound, and prices them with the Evaluator: stage cuts by the balanced
partition (per layer signature), per-layer tensor-parallel sharding by the
ILP, and every recompute mode and ZeRO stage. A shape whose lower bound is no
better than the best plan found is pruned without being priced. The bound
(perfectly balanced compute and tensor-parallel traffic, the schedule's fill
and drain, the cheapest pipeline send per cut; no recompute, no data-parallel
sync, no optimizer) is below the price of every variant of the shape, so
pruning never loses the optimum within the cost model.
"""

from __future__ import annotations

import dataclasses

import difflib
import math
import time
from dataclasses import dataclass, field
from typing import Any

from cost_models.hardware import Cluster
from cost_models.prediction import Prediction
from cost_models.overlap import Overlap
from planner.capabilities import MESHPLAN_RUNTIME, RuntimeSupport, TargetError
from planner.config import ConfigError, ParallelConfig
from planner.config_fields import ConfigFields
from planner.execution_choice import choose
from planner.evaluator import Evaluator, as_graph
from planner.fixed_plan import plan_for
from planner.plan import Alternative, Plan
from planner.progress import Progress
from planner.strategies import describe
from planner.strategies.base import MeshShape, SplitAnalysis
from runtime.vocab import DType, RecomputeMode, Target

OBJECTIVES = ("time", "energy")
# every ParallelConfig field can be pinned by a constraint, but the stage boundaries (the search places them)
FIXED_KNOBS = tuple(f.name for f in dataclasses.fields(ConfigFields) if f.name != "stage_boundaries")
LIMITS = ("max_memory_fraction", "max_step_energy_j", "max_step_time_s", "allow_cross_node_tensor",
          "max_micro_batch_size")
RECOMPUTE_ORDER = tuple(RecomputeMode)   # least recomputation first: none, selective, full


class NoFeasiblePlan(ValueError):
    """No configuration fits; the message says what the smallest one needs and what would help."""


@dataclass
class _Search:
    bases: int = 0
    evaluated: int = 0
    pruned: int = 0
    infeasible: int = 0
    seconds: float = 0.0
    priced: list[tuple[ParallelConfig, Prediction]] = field(default_factory=list)
    refused: list[tuple[ParallelConfig, str]] = field(default_factory=list)  # roles the split analysis refused
    blocked: str | None = None   # the first refusal of the target's runtime in the inner loop


def optimize(model_or_graph: Any, cluster: Cluster, *, global_batch_size: int, example_inputs: Any = None,
             objective: str = "time", constraints: dict | None = None, progress: bool | None = None,
             keep_alternatives: int = 8, runtime: RuntimeSupport | None = MESHPLAN_RUNTIME,
             target: Target | str | None = None, **evaluator_options: Any) -> Plan:
    """Search for the plan that minimizes `objective` under `constraints`.

    Args:
        model_or_graph: a ModelGraph, or an nn.Module with `example_inputs`.
        cluster: where it will run; every device is used.
        global_batch_size: samples per optimizer step.
        objective: "time" (seconds per step) or "energy" (joules per step).
        constraints: fixed knobs ({"tensor": 8, "schedule": "1f1b", ...}) and limits:
            max_memory_fraction (of device memory, default 1.0), max_step_energy_j,
            max_step_time_s, allow_cross_node_tensor (default False), max_micro_batch_size.
        progress: show a progress bar (None: only on a terminal and past ~1 s).
        keep_alternatives: how many runner-up configurations the plan records for explain().
        runtime: what the runtime executes (default: meshplan's); only those configurations are
            searched. None searches everything the cost model prices (a what-if search).
        target: what will run the plan, a runtime.vocab.Target or its string ("meshplan", "torch"):
            searches what that target runs (planner/capabilities.py), priced with its stack's overlap
            unless `overlap` is given, and records the target in the plan. Give `target` or `runtime`,
            not both.
        evaluator_options: passed to the Evaluator (efficiency, fused_attention, overlap, ...).

    Raises:
        NoFeasiblePlan: nothing fits; names the smallest need and the knobs that would help.
        ValueError: unknown objective or constraint (with the closest known name).
        TargetError: an unknown target, or a target given together with `runtime`.
    """
    t0 = time.perf_counter()
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not one of {', '.join(OBJECTIVES)}")
    runtime, evaluator_options = _resolve_target(target, runtime, evaluator_options)
    cons = _check_constraints(constraints or {})
    graph = as_graph(model_or_graph, example_inputs)
    ev = _evaluator(graph, cluster, cons, runtime, evaluator_options)
    splits = ev.splitter.split_analysis(graph)
    search = _Search()
    bases = _searched_shapes(ev, cluster, global_batch_size, cons, runtime)
    search.bases = len(bases)
    if not bases:
        raise NoFeasiblePlan(_no_base_message(ev, cluster, global_batch_size, cons))
    best = _branch_and_bound(ev, bases, global_batch_size, objective, cons, search, runtime, splits, progress, t0)
    if best is None and not search.priced and search.blocked and runtime is not None:
        raise NoFeasiblePlan(_blocked_message(runtime, search.blocked))
    if best is None:
        raise NoFeasiblePlan(_infeasible_message(search, cluster, cons))
    return _plan_of(ev, best, global_batch_size, objective, cons, search, runtime, splits, keep_alternatives,
                    chose_execution="execution" in evaluator_options)


def _resolve_target(target: Target | str | None, runtime: RuntimeSupport | None,
                    evaluator_options: dict) -> tuple[RuntimeSupport | None, dict]:
    """The runtime a `target` runs, and the Evaluator options with its stack's overlap (unless given)."""
    if target is None:
        return runtime, evaluator_options
    if runtime is not MESHPLAN_RUNTIME:
        raise TargetError(f"optimize got target={str(target)!r} and a runtime; give one: the target says what "
                          "runs the plan, runtime=None searches what no target runs (a what-if search)")
    runtime = RuntimeSupport.for_target(target)
    return runtime, {"overlap": Overlap.preset(runtime.stack), **evaluator_options}


def _evaluator(graph, cluster: Cluster, cons: dict, runtime: RuntimeSupport | None,
               evaluator_options: dict) -> Evaluator:
    """The Evaluator the search prices with: memory capped by max_memory_fraction (bytes per device) and,
    for a runtime, tensor sharding limited to the regions its code generator can split."""
    ev = Evaluator(graph, cluster, **evaluator_options)
    ev.memory_cap = cluster.device.memory_bytes * cons.get("max_memory_fraction", 1.0)
    if runtime is not None:   # price only the tensor-parallel regions the code generator can split
        # only the degrees the search enumerates (_enumerate_shapes): a region that one never-searched
        # degree cannot split (heads not divisible by it) must not be replicated for all of them
        max_t = cluster.num_devices if cons.get("allow_cross_node_tensor") else cluster.devices_per_node
        degrees = [cons["tensor"]] if "tensor" in cons else \
            [t for t in _divisors(cluster.num_devices) if 2 <= t <= max_t and _divides_splits(ev, t)]
        ev.sharding = runtime.splittable(graph, ev.sharding, degrees)
    return ev


def _searched_shapes(ev: Evaluator, cluster: Cluster, batch: int, cons: dict,
                     runtime: RuntimeSupport | None) -> list[ParallelConfig]:
    """The base configurations (mesh shape, micro-batch, schedule, dtype) the runtime runs; raises
    NoFeasiblePlan naming the runtime's first refusal when it runs none of the ones the cost model prices."""
    dtypes = runtime.dtypes if runtime is not None else (DType.BF16, DType.FP16, DType.FP32)
    bases = _enumerate(ev, cluster, batch, cons, dtypes)
    if runtime is not None:
        blocked = [runtime.why_not(b, batch) for b in bases if not runtime.allows(b, batch)]
        bases = [b for b in bases if runtime.allows(b, batch)]
        if not bases and blocked:
            raise NoFeasiblePlan(_blocked_message(runtime, blocked[0]))
    return bases


def _branch_and_bound(ev: Evaluator, bases: list[ParallelConfig], batch: int, objective: str, cons: dict,
                      search: _Search, runtime: RuntimeSupport | None, splits: SplitAnalysis, progress: bool | None,
                      t0: float) -> tuple[float, ParallelConfig, Prediction] | None:
    """Prices the bases in the order of their lower bounds, pruning each whose bound is no better than the
    best found; returns (objective value, config, prediction) of the best that fits, or None. `search` counts
    what was priced and pruned, and its seconds run from `t0` (time.perf_counter())."""
    bound = [(_lower_bound(ev, cfg, batch, objective), k, cfg) for k, cfg in enumerate(bases)]
    bound.sort(key=lambda x: (x[0], x[1]))
    best: tuple[float, ParallelConfig, Prediction] | None = None
    bar = Progress(len(bound), "meshplan optimize", enabled=progress)
    for done, (lb, _, base) in enumerate(bound, 1):
        bar.update(done, f"priced {search.evaluated}, pruned {search.pruned}"
                   + (f", best {best[0]:.4g}" if best else ""))
        if best is not None and lb >= best[0]:
            search.pruned += 1
            continue
        best = _inner(ev, base, batch, objective, cons, search, best, runtime, splits)
    search.seconds = time.perf_counter() - t0
    bar.close(f"{search.evaluated} priced, {search.pruned} pruned")
    return best


def _plan_of(ev: Evaluator, best: tuple[float, ParallelConfig, Prediction], batch: int, objective: str, cons: dict,
             search: _Search, runtime: RuntimeSupport | None, splits: SplitAnalysis, keep_alternatives: int,
             chose_execution: bool) -> Plan:
    """The Plan of the best configuration, with the search's figures and its runners-up. Unless the caller
    fixed the execution options (`chose_execution`), the ones that pay for this configuration are chosen."""
    stats = (("candidates", search.bases), ("evaluated", search.evaluated), ("pruned", search.pruned),
             ("rejected", search.infeasible), ("seconds", round(search.seconds, 3)), ("objective", objective))
    if not chose_execution:   # the execution options that pay for the chosen configuration
        ev, _ = choose(ev, best[1], batch, objective, fits=lambda pred: _fits(pred, cons))
    plan = plan_for(ev, best[1], batch, search=stats, splits=splits,
                    target=runtime.target if runtime is not None else Target.MESHPLAN)
    alts = _alternatives(search, best, objective, cons, keep_alternatives)
    return Plan(**{**{f: getattr(plan, f) for f in plan.__dataclass_fields__}, "alternatives": alts})


def _inner(ev: Evaluator, base: ParallelConfig, batch: int, objective: str, cons: dict, search: _Search, best,
           runtime: RuntimeSupport | None, splits: SplitAnalysis):
    """Every recompute mode and ZeRO stage for one shape; keeps the best that fits.

    All of them are priced: ZeRO-2's half-size reduce-scatter can beat plain
    all-reduce, and recomputation widens the window that hides the gradient
    sync, so neither knob is monotone in time.
    """
    # the split analysis' verdict on the shape's tensor roles, asked once: the roles follow the tensor
    # degree, micro-batch and dtype (planner/strategies/tensor/strategy.py caches them so), not recompute or ZeRO
    why: str | None = None
    checked = base.tensor == 1
    for recompute in _options(cons, "recompute", RECOMPUTE_ORDER):
        for zero in _options(cons, "zero", (0, 1, 2, 3) if base.data > 1 else (0,)):
            try:
                cfg = base.replace(recompute=recompute, zero=zero)
            except ConfigError:   # a combination planner/strategies/combinations.py refuses
                continue
            if runtime is not None and (refusal := runtime.why_not(cfg, batch)):
                search.blocked = search.blocked or refusal
                continue
            try:
                pred = ev.evaluate(cfg, batch)
            except ConfigError:
                search.infeasible += 1
                continue
            if not checked:
                why, checked = splits.refusal(ev.node_roles(cfg), cfg), True
            if why is not None:   # a plan must lower: roles the split analysis refuses are skipped
                search.infeasible += 1
                search.refused.append((cfg, why))
                continue
            if runtime is not None and (refusal := runtime.why_not_splits(
                    cfg, lambda: splits.get(ev.node_roles(cfg), cfg))):
                search.blocked = search.blocked or refusal   # the target cannot run this split with this ZeRO
                continue
            search.evaluated += 1
            search.priced.append((cfg, pred))
            value = _objective(pred, objective)
            if _fits(pred, cons) and (best is None or value < best[0]):
                best = (value, cfg, pred)
    return best


def explain(plan: Plan, top: int = 5) -> str:
    """The chosen plan beside the next best alternatives, with the reason each lost."""
    p = plan.prediction
    lines = [f"chosen: {plan.config.short():<44} step {p.step_time * 1e3:>11.3f} ms  "
             f"mem {p.peak_memory / 2**30:>8.3f} GiB  energy {p.step_energy:>10.1f} J"]
    lines += describe.explain_lines(plan)
    if not plan.alternatives:
        lines.append("no alternatives recorded (the plan was made for a fixed configuration; "
                     "planner.optimize records the runners-up)")
        return "\n".join(lines)
    lines.append(f"{'#':>3}  {'alternative':<44} {'step ms':>11} {'vs best':>8} {'mem GiB':>9}  lost on")
    for k, a in enumerate(plan.alternatives[:top], 1):
        rel = a.step_time / p.step_time - 1 if p.step_time else 0.0
        lines.append(f"{k:>3}  {a.config.short():<44} {a.step_time * 1e3:>11.3f} {rel:>+8.1%} "
                     f"{a.peak_memory / 2**30:>9.3f}  {a.reason}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------


def _check_constraints(cons: dict) -> dict:
    known = FIXED_KNOBS + LIMITS
    for key in cons:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown constraint {key!r}{hint}; known: {', '.join(known)}")
    frac = cons.get("max_memory_fraction", 1.0)
    if not 0 < frac <= 1:
        raise ValueError(f"max_memory_fraction must be in (0, 1], got {frac!r}")
    return dict(cons)


def _options(cons: dict, key: str, default: tuple) -> tuple:
    return (cons[key],) if key in cons else default


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) steps (n may be a batch of 2**31)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def _divides_splits(ev: Evaluator, t: int) -> bool:
    """Whether tensor degree `t` divides every split size that cannot be padded (heads...)."""
    try:
        ev.sharding.check(t)
    except ValueError:
        return False
    return True


def _best_dtype(cluster: Cluster, allowed: tuple[str, ...]) -> str:
    """The training dtype with the highest peak FLOP/s that the device has and the runtime trains in;
    on a tie bf16, then fp16, then fp32 (bf16 needs no loss scaling). A V100 (no bf16) trains in fp16;
    a CPU whose fp16 products are slower than fp32 keeps fp32."""
    order = (DType.BF16, DType.FP16, DType.FP32)
    have = [dt for dt in order if dt in cluster.device.dtypes and dt in allowed]
    if not have:
        raise ValueError(f"device {cluster.device.name} has none of {', '.join(allowed)} in its peak table")
    return max(have, key=lambda dt: (cluster.device.peak(dt), -order.index(dt)))


def _enumerate(ev: Evaluator, cluster: Cluster, batch: int, cons: dict,
               dtypes: tuple[str, ...]) -> list[ParallelConfig]:
    """Every mesh shape x micro-batch x schedule, then each strategy's variants that take part of the
    devices (spatial tiles, sub-grids), that the constraints allow (recompute/ZeRO come later). A
    strategy the constraints pin on leaves only the configs that use it."""
    n = cluster.num_devices

    def shapes_of(devices: int) -> list[ParallelConfig]:
        return _enumerate_shapes(ev, cluster, devices, batch, cons, dtypes)

    pinned = [s for s in ev.strategies if s.pinned_on(cons)]
    out = [] if pinned else shapes_of(n)
    for strategy in ev.strategies:
        out += [cfg for cfg in strategy.variants(ev, n, cons, shapes_of) if all(s.active(cfg) for s in pinned)]
    return out


def _enumerate_shapes(ev: Evaluator, cluster: Cluster, n: int, batch: int, cons: dict,
                      dtypes: tuple[str, ...]) -> list[ParallelConfig]:
    """Data x tensor x pipeline shapes of `n` devices, with what each strategy adds per shape
    (micro-batches and schedules, bi-directional replicas)."""
    layers = len(ev.graph.layers)
    dtype = cons.get("dtype") or _best_dtype(cluster, dtypes)
    max_t = n if cons.get("allow_cross_node_tensor") else cluster.devices_per_node
    out = []
    for t in _options(cons, "tensor", tuple(d for d in _divisors(n) if d <= max_t)):
        try:
            ev.sharding.check(t)
        except ValueError:
            continue
        for p in _options(cons, "pipeline", tuple(_divisors(n // t) if n % t == 0 else ())):
            if n % (t * p) or p > layers:
                continue
            d = n // (t * p)
            if "data" in cons and cons["data"] != d:
                continue
            if batch % d:
                continue
            cap = cons.get("max_micro_batch_size", batch // d)
            mbs = _options(cons, "micro_batch_size", tuple(m for m in _divisors(batch // d) if m <= cap))
            shape = MeshShape(degrees=(("data", d), ("tensor", t), ("pipeline", p)), micro_batch_sizes=mbs,
                              max_micro_batch_size=cap, dtype=dtype, num_layers=layers, global_batch_size=batch)
            for strategy in ev.strategies:
                out += strategy.shape_configs(shape, cons)
    return out


def _lower_bound(ev: Evaluator, cfg: ParallelConfig, batch: int, objective: str) -> float:
    """Compute-only bound: perfectly balanced stages, no bubble, no recompute, no data-parallel sync.

    Every configuration derived from `cfg` by the inner loop costs at least this much.
    """
    try:
        costs = ev.layer_costs(cfg)
    except ConfigError:
        return float("inf")
    m = batch // (cfg.micro_batch_size * cfg.data)
    compute = sum(c.forward + c.backward for c in costs)
    comm = sum(c.comm_forward + c.comm_backward for c in costs)
    if objective == "energy":  # every device is busy at least its share of the compute
        return cfg.num_devices * m * compute / cfg.pipeline * ev.cluster.device.active_watts
    # The slowest device's slot is at least the average over devices; the placement adds
    # what its schedule must (cuts, fill and drain).
    slot = (compute + comm) / cfg.pipeline
    return ev.placement(cfg).lower_bound(ev, cfg, costs, m, slot)


def _objective(pred: Prediction, objective: str) -> float:
    return pred.step_time if objective == "time" else pred.step_energy


def _fits(pred: Prediction, cons: dict) -> bool:
    if pred.peak_memory > pred.memory_capacity * cons.get("max_memory_fraction", 1.0):
        return False
    if "max_step_energy_j" in cons and pred.step_energy > cons["max_step_energy_j"]:
        return False
    if "max_step_time_s" in cons and pred.step_time > cons["max_step_time_s"]:
        return False
    return True


def _reason(pred: Prediction, best: Prediction, cons: dict) -> str:
    cap = pred.memory_capacity * cons.get("max_memory_fraction", 1.0)
    gib = 2**30
    if pred.peak_memory > cap:
        return f"memory: needs {pred.peak_memory / gib:.2f} GiB of {cap / gib:.2f} GiB"
    if "max_step_energy_j" in cons and pred.step_energy > cons["max_step_energy_j"]:
        return f"energy: {pred.step_energy:.1f} J over the {cons['max_step_energy_j']} J cap"
    if "max_step_time_s" in cons and pred.step_time > cons["max_step_time_s"]:
        return f"time: {pred.step_time:.4g} s over the {cons['max_step_time_s']} s cap"
    a, b = pred.time, best.time
    groups = {
        "bubble": a.bubble - b.bubble,
        "communication": (a.tensor_comm + a.pipeline_comm + a.data_comm + a.zero_comm)
        - (b.tensor_comm + b.pipeline_comm + b.data_comm + b.zero_comm),
        "compute": (a.forward + a.backward) - (b.forward + b.backward),
        "recompute": a.recompute - b.recompute,
        "optimizer": a.optimizer - b.optimizer,
    }
    name, diff = max(groups.items(), key=lambda kv: kv[1])
    if diff <= 0:
        return "energy" if pred.step_energy > best.step_energy else "tie"
    return f"{name} (+{diff * 1e3:.3f} ms)"


def _alternatives(search: _Search, best, objective: str, cons: dict, keep: int) -> tuple[Alternative, ...]:
    _, best_cfg, best_pred = best
    seen = {best_cfg}
    ranked = sorted(search.priced, key=lambda cp: (not _fits(cp[1], cons), _objective(cp[1], objective)))
    out = []
    for cfg, pred in ranked:
        if cfg in seen:
            continue
        seen.add(cfg)
        out.append(Alternative(config=cfg, step_time=pred.step_time, peak_memory=pred.peak_memory,
                               step_energy=pred.step_energy, fits=_fits(pred, cons),
                               reason=_reason(pred, best_pred, cons)))
        if len(out) >= keep:
            break
    return tuple(out)


def _blocked_message(runtime: RuntimeSupport, refusal: str) -> str:
    return (f"every configuration the constraints allow needs something the {runtime.target} target cannot run "
            f"({refusal}); pass runtime=None for a what-if search")


def _smallest(search: _Search) -> tuple[ParallelConfig, Prediction] | None:
    return min(search.priced, key=lambda cp: cp[1].peak_memory, default=None)


def _infeasible_message(search: _Search, cluster: Cluster, cons: dict) -> str:
    small = _smallest(search)
    gib = 2**30
    cap = cluster.device.memory_bytes * cons.get("max_memory_fraction", 1.0)
    if small is None:
        refused = f" (tensor parallelism refused: {search.refused[0][1]})" if search.refused else ""
        return (f"no configuration of this model could be priced on {cluster.name} "
                f"({cluster.num_devices} devices){refused}; relax the constraints {cons}")
    cfg, pred = small
    m = pred.memory
    helps = []
    if cfg.recompute != "full":
        helps.append("recompute='full'")
    if cfg.zero < 3 and cfg.data > 1:
        helps.append("ZeRO stage 3")
    if cfg.micro_batch_size > 1:
        helps.append("a smaller micro-batch")
    need_devices = cluster.num_devices * max(2, int(-(-pred.peak_memory // cap)))
    helps.append(f"more devices (about {need_devices}, so weights and optimizer state spread thinner)")
    why = ""
    if pred.peak_memory <= cap:
        why = " (it fits in memory but breaks the energy or time cap)"
    return (f"no plan fits on {cluster.name}: the smallest configuration found ({cfg.short()}) needs "
            f"{pred.peak_memory / gib:.2f} GiB per device (parameters {m.parameters / gib:.2f}, gradients "
            f"{m.gradients / gib:.2f}, optimizer {m.optimizer / gib:.2f}, activations {m.activations / gib:.2f}), "
            f"and a device offers {cap / gib:.2f} GiB{why}. What would help: {', '.join(helps)}. "
            f"Searched {search.bases} shapes, priced {search.evaluated}.")


def _no_base_message(ev: Evaluator, cluster: Cluster, batch: int, cons: dict) -> str:
    hard = [f"{w} = {s}" for w, s, pad, _r in ev.sharding.constraints if not pad][:3]
    return (f"no mesh shape of {cluster.num_devices} devices suits this model and global batch {batch} "
            f"under constraints {cons}: the data degree must divide the batch, the tensor degree must divide "
            f"{', '.join(hard) or 'the split sizes'}, and the "
            f"pipeline cannot exceed {len(ev.graph.layers)} layers. Change the batch size, device count or constraints.")
