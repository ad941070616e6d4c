"""`codegen.partition`: cut the fx graph into per-stage modules, split for tensor parallelism.

For each pipeline stage of a Plan:

* its nodes are the nodes of its layers; its inputs are the model inputs its
  layers read (from the data) and every value made by an earlier stage that
  this or a later stage reads (from the previous stage, passed along when a
  later stage needs it); its outputs are the next stage's received inputs;
* its code is one method per layer (torch.fx's Python, with tensor-parallel
  local sizes) and a forward that chains them (through
  torch.utils.checkpoint per layer when the plan recomputes); what a strategy changes
  in a stage's code is its StageCodePart's (codegen/stage_parts.py: the layers of a
  spatial part on image tiles, the paths of a sub-graph region on their sub-grids);
* its `StageSpec` lists the local shape of every boundary tensor for one
  micro-batch, the modules its code calls and how each is split.

Everything is decided here, once, from the graph and the plan; a rank only
builds the modules and runs the code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from codegen.head import find_head, fuse, narrow_logits, output_head, padded_rows
from codegen.pysrc import import_block
from codegen.stage_parts import StageCodePart
from codegen.stage_source import stage_source
from codegen.stages import GraphRewrite, Partition, PartitionError, StageCodeMaker, StageCut, StagePart
from codegen.strategies.registry import node_split_lowering
from planner.binding import graph_mismatch
from planner.graph.model import ModelGraph
from planner.graph.ops import module_path_of, op_base
from planner.plan import Plan
from runtime.materialize import RUNTIME_ATTRS, model_signature
from runtime.spec import StageSpec


def example_inputs(graph: ModelGraph, batch: int) -> dict[str, torch.Tensor]:
    """Meta tensors for the graph's placeholders with `batch` samples on the batch dim."""
    out = {}
    for n in graph.nodes:
        if n.op != "placeholder" or not n.output_meta:
            continue
        m = n.output_meta[0]
        shape = list(m.shape)
        if shape:
            shape[graph.batch_dim] = batch
        out[n.name] = torch.empty(shape, dtype=getattr(torch, m.dtype), device="meta")
    return out


def partition(plan: Plan, graph: ModelGraph, *, rewrite: GraphRewrite | None = None,
              stage_code: Sequence[StageCodeMaker] = ()) -> Partition:
    """Per-stage modules for `plan` (see module docstring).

    rewrite(gm, inputs): a strategy's rewrite of the captured graph before the tensor-parallel split,
    and the meta stand-ins of the runtime attributes it reads (context parallelism:
    codegen/strategies/context/stage_code.py). stage_code: the strategies' makers of their parts in
    the stages' code, each (the cut) -> {stage index: its StageCodePart} (codegen/lower.py passes
    those of the plan's strategies: LoweringStrategy.stage_code).

    Raises PartitionError / TensorSplitError / SpatialError (ValueErrors) naming what cannot be cut or split.
    """
    gm = graph.module
    if gm is None:
        raise PartitionError("the ModelGraph has no fx module (it was loaded from JSON); capture the model again "
                             "with planner.capture")
    mismatch = graph_mismatch(plan, graph)
    if mismatch:
        raise PartitionError(f"{mismatch}; make the plan again for this graph")
    _check_runnable(gm)
    cfg = plan.config
    inputs = example_inputs(graph, cfg.micro_batch_size)
    rewritten, attrs = rewrite(gm, inputs) if rewrite is not None else (None, None)
    res = node_split_lowering().split_stage_graph(plan, graph, inputs, rewritten, attrs)
    cut = cut_stages(plan, graph, res)
    code_parts: dict[int, list[StageCodePart]] = {}
    for make in stage_code:
        for s, part in make(cut).items():
            code_parts.setdefault(s, []).append(part)
    shared = _Shared(shared_names(graph), code_parts, _compiled_layers(graph))
    parts = tuple(_stage_part(plan, graph, cut, st, shared) for st in sorted(plan.stages, key=lambda s: s.index))
    sd = gm.state_dict(keep_vars=True)
    return Partition(parts, plan.split_ranks, cfg.micro_batch_size, _signature_of(gm),
                     {k: list(v.shape) for k, v in sd.items()})


def cut_stages(plan: Plan, graph: ModelGraph, res) -> StageCut:
    """Where `res.graph` (the split graph) is cut into the plan's stages (StageCut)."""
    g = res.graph
    head, head_extra, padded_names = _output_layer(g, graph.module, graph, res, plan.execution,
                                                   plan.split_ranks, plan)
    nodes = list(g.nodes)
    pos = {n.name: i for i, n in enumerate(nodes)}
    layer_of = {name: layer.name for layer in graph.layers for name in layer.nodes}
    stage_of_layer, known = _stage_of_layers(plan, graph)
    stage_of = _stage_of_nodes(nodes, pos, layer_of, stage_of_layer, known, len(plan.stages))
    last_use = {n.name: max((stage_of[u.name] for u in n.users), default=-1) for n in nodes if n.op != "get_attr"}
    crossing = {s: [n for n in nodes if n.op not in ("output", "get_attr") and stage_of[n.name] < s <= last_use[n.name]]
                for s in range(len(plan.stages))}
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    return StageCut(res, nodes, pos, layer_of, stage_of, stage_of_layer, known, crossing, placeholders, head,
                    head_extra, padded_names)


def _stage_of_layers(plan: Plan, graph: ModelGraph) -> tuple[dict[str, int], list[str]]:
    """(layer name -> stage index, the layer names in model order); PartitionError unless the plan's stages
    hold every layer once, in model order."""
    stage_of_layer: dict[str, int] = {}
    order = []
    for st in sorted(plan.stages, key=lambda s: s.index):
        for lname in st.layers:
            if lname in stage_of_layer:
                raise PartitionError(f"layer {lname!r} is in stages {stage_of_layer[lname]} and {st.index}")
            stage_of_layer[lname] = st.index
            order.append(lname)
    known = [layer.name for layer in graph.layers]
    if order != known:
        missing = [x for x in known if x not in stage_of_layer]
        raise PartitionError("the plan's stages must hold every layer once, in model order"
                             + (f"; missing {missing[:3]}" if missing else f"; got {order[:4]}..."))
    return stage_of_layer, known


def _stage_of_nodes(nodes: list[fx.Node], pos: dict[str, int], layer_of: dict[str, str],
                    stage_of_layer: dict[str, int], known: list[str], num_stages: int) -> dict[str, int]:
    """Node name -> stage index for every node but get_attr (`layer_of` gains the nodes the split inserted).

    A parameter or buffer read directly (get_attr) belongs to no stage: every stage that reads it holds it
    (a weight shared by two stages is held by both; runtime/execute/ties.py keeps the copies equal)."""
    stage_of: dict[str, int] = {}
    for n in reversed(nodes):  # inserted nodes (local-size arithmetic) join their first user
        if n.op == "get_attr":
            continue
        if n.op == "output":
            stage_of[n.name] = num_stages - 1
            layer_of.setdefault(n.name, known[-1])
        elif n.name in layer_of:
            stage_of[n.name] = stage_of_layer[layer_of[n.name]]
        else:
            users = sorted(n.users, key=lambda u: pos[u.name])
            if not users:
                raise PartitionError(f"node {n.name!r} belongs to no layer")
            stage_of[n.name] = stage_of[users[0].name]
            layer_of[n.name] = layer_of[users[0].name]
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op != "get_attr" and n.op != "get_attr" and stage_of[a.name] > stage_of[n.name]:
                raise PartitionError(f"node {n.name!r} in stage {stage_of[n.name]} reads {a.name!r} from a "
                                     f"later stage {stage_of[a.name]}")
    return stage_of


@dataclass(frozen=True)
class _Shared:
    """What every stage's part is made with: the canonical name of each shared weight, and the strategies'
    parts of each stage's code."""

    canonical: dict[str, str]
    code_parts: dict[int, list[StageCodePart]]
    compiled_layers: frozenset[str]   # the layers whose methods torch.compile compiles (regional compilation)


def _stage_part(plan: Plan, graph: ModelGraph, cut: StageCut, st, shared_by: _Shared) -> StagePart:
    """Stage `st`'s StagePart: its boundaries, modules and attributes, source, spec and parameters."""
    cfg, ex, gm, res = plan.config, plan.execution, graph.module, cut.res
    s, nodes, stage_of = st.index, cut.nodes, cut.stage_of
    own = [n for n in nodes if n.op != "get_attr" and stage_of[n.name] == s]
    read = {a.name for n in own for a in n.all_input_nodes if a.op == "get_attr"}
    members = [n for n in nodes if (n.op != "get_attr" and stage_of[n.name] == s) or n.name in read]
    data_in = [cut.boundary(n, "data", cut.placeholders.index(n.name)) for n in members if n.op == "placeholder"]
    recv_in = [cut.boundary(v, "recv") for v in cut.crossing[s]]
    ins = sorted(data_in + recv_in, key=lambda b: cut.pos[b.name])
    is_last = s == len(plan.stages) - 1
    outs = [] if is_last else [cut.boundary(v, "send") for v in cut.crossing[s + 1]]
    modules = tuple(dict.fromkeys(str(n.target) for n in members if n.op == "call_module"))
    attributes = tuple(dict.fromkeys(str(n.target) for n in members
                                     if n.op == "get_attr" and n.target not in RUNTIME_ATTRS))
    if is_last:   # a fused output layer: its tensors are held, though no code calls it
        modules = tuple(dict.fromkeys(modules + cut.head_extra[0]))
        attributes = tuple(dict.fromkeys(attributes + cut.head_extra[1]))
    source, globs, served = stage_source(res.graph, s, members, ins, outs, is_last, cut.layer_of, cut.known,
                                          cfg.recompute, shared_by.code_parts.get(s, ()), shared=ex.compile,
                                          gm=gm, signatures={L.name: L.signature for L in graph.layers})
    padded = _padded(cut.padded_names, modules, attributes, ex.vocab_multiple, cut.head)
    params = _stage_params(gm, modules, attributes, res.shards, shared_by.canonical, res.param_shards,
                           plan.split_ranks, padded)
    held = {shared_by.canonical.get(name, name) for name, _, _ in params}
    shared = tuple(grp for grp in graph.shared_params if grp[0] in held)
    spec = StageSpec(index=s, layers=st.layers, inputs=tuple(ins), outputs=tuple(outs), modules=modules,
                     attributes=attributes, shards=tuple(res.shards[m] for m in modules if m in res.shards),
                     is_last=is_last, output_split=res.output_split if is_last else None,
                     recompute=cfg.recompute, shared=shared,
                     param_shards=tuple(res.param_shards[a] for a in attributes if a in res.param_shards),
                     running_stats=_running_stats(res.graph, gm, members), head=cut.head if is_last else None,
                     padded=padded, compiled=_compiled_methods(shared_by.compiled_layers, served, ex) if ex.compile else ())
    return StagePart(spec, st.device_index, f"Stage{s}", source, globs, tuple(params))


def _compiled_layers(graph: ModelGraph) -> frozenset[str]:
    """Regional compilation: the repeated blocks (those holding parameters); in a model without repeated
    blocks, the layers that hold parameters (a few views or an activation alone: never)."""
    signatures = [L.signature for L in graph.layers]
    weighty = {L.name for L in graph.layers if L.param_count > 0}
    blocks = {L.name for L in graph.layers if signatures.count(L.signature) > 1} & weighty
    return frozenset(blocks or weighty)


def _compiled_methods(layers: frozenset[str], served: dict[str, list[str]], ex) -> tuple[str, ...]:
    """The stage methods torch.compile compiles: those running one of `layers` (one method per distinct
    block); under CompileScope.STAGE, the stage's whole forward."""
    if ex.whole_stage:   # the stage's whole forward, one compiled function (runtime/execution.py CompileScope)
        return ("forward",)
    return tuple(m for m, ls in served.items() if any(L in layers for L in ls))


def _output_layer(g: fx.Graph, gm: fx.GraphModule, graph: ModelGraph, res, ex, t: int,
                  plan: Plan) -> tuple[Any, tuple[tuple[str, ...], tuple[str, ...]], tuple[str, ...]]:
    """The output layer's part of the stage graph `g` (codegen/head.py), rewritten in place: (the last
    stage's OutputHead or None, (modules, attributes) the last stage holds for a fused layer that its
    code no longer calls, the model's names of the tensors whose rows are padded at tensor degree 1); None
    and nothing without a fused loss or a padded vocabulary."""
    if not (ex.chunked or ex.vocab_multiple > 1):
        return None, ((), ()), ()
    site, _ = find_head(g, gm)
    if site is None:
        return None, ((), ()), ()
    fused = ex.chunked
    layer = next((L.name for L in graph.layers if site.linear.name in L.nodes), None)
    if fused and layer is not None and layer not in plan.stages[-1].layers:
        raise PartitionError(f"--loss-impl chunked: the output layer ({layer}) is not in the last pipeline stage; "
                             "cut the stages so that it is, or leave --loss-impl out")
    sequence_dim = res.shards[site.module].sequence_dim if site.module in res.shards else None
    head = output_head(site, fused, sequence_dim)
    v_pad = -(-site.vocab // ex.vocab_multiple) * ex.vocab_multiple
    pad_here = t == 1 and v_pad != site.vocab
    extra: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    if fused:
        extra = ((site.module,), ()) if site.module is not None else \
            ((), tuple(x for x in (site.weight, site.bias) if x is not None))
        fuse(g, site)
    elif pad_here:
        narrow_logits(g, site, [res.local_values, res.full_values])
    if not pad_here:
        return head, extra, ()
    names = [site.weight] + ([site.bias] if site.bias is not None else [])
    for grp in graph.shared_params:   # a tied embedding holds the same rows
        if site.weight in grp:
            names += [n for n in grp if n not in names]
    return head, extra, tuple(names)


def _padded(names: tuple[str, ...], modules: tuple[str, ...], attributes: tuple[str, ...], multiple: int,
            head) -> tuple:
    """StageSpec.padded of a stage holding `modules` and `attributes`: those of the padded tensors
    `names` (the model's names) it holds, under each name it holds them by."""
    if not names:
        return ()
    held = [n for n in names if n in attributes or n.rpartition(".")[0] in modules]
    return padded_rows(head.vocab, multiple, held)


_BATCH_NORM_OPS = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_functional", "cudnn_batch_norm")


def _running_stats(g: fx.Graph, gm: fx.GraphModule, members: list[fx.Node]) -> tuple[str, ...]:
    """The BatchNorm running statistics the stage updates: of BatchNorm modules it calls, and
    buffers an ATen batch_norm reads directly."""
    out: list[str] = []
    for n in members:
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            if isinstance(mod, torch.nn.modules.batchnorm._NormBase) and mod.track_running_stats:
                out += [f"{n.target}.running_mean", f"{n.target}.running_var"]
        elif n.op == "call_function" and op_base(n.target) in _BATCH_NORM_OPS:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and str(a.target).rsplit(".", 1)[-1] in ("running_mean", "running_var"):
                    out.append(str(a.target))
    return tuple(dict.fromkeys(out))


def _check_runnable(gm: fx.GraphModule) -> None:
    """PartitionError naming the op and module path of anything generated code cannot call."""
    state = {*dict(gm.named_parameters(remove_duplicate=False)), *dict(gm.named_buffers(remove_duplicate=False))}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and str(n.target) not in state and str(n.target) not in RUNTIME_ATTRS:
            obj = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, torch.Tensor):
                raise PartitionError(f"node {n.name!r} at {module_path_of(n) or 'the top level'} reads {n.target!r}, "
                                     "a tensor forward() creates that torch.export lifted out of it and that the "
                                     "model does not hold; make it a registered buffer of the module")
        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
            raise PartitionError(f"node {n.name!r} at {module_path_of(n) or 'the top level'} is torch.export's "
                                 f"{n.target.name()} region, which code generation cannot run (a torch.autocast "
                                 "block inside the model's forward()); remove that block, and set the run's dtype "
                                 "with the plan instead")


def shared_names(graph: ModelGraph) -> dict[str, str]:
    """Every name of a parameter the model uses under several names -> its canonical (first) name."""
    return {name: grp[0] for grp in graph.shared_params for name in grp}


def _stage_params(gm: fx.GraphModule, modules: tuple[str, ...], attributes: tuple[str, ...], shards: dict,
                  canonical: dict[str, str], param_shards: dict, tensor: int,
                  padded: tuple = ()) -> list[tuple[str, tuple[int, ...], str]]:
    """The stage module's trainable parameters (name, local shape, dtype), in the order gradients
    become ready in backward (last module first). A split module's (`shards`: path -> ModuleShard) and a
    split weight's (`param_shards`) local shapes come from their split's description.

    A parameter the stage reaches under several names (a tied weight whose two users are both
    here) is one parameter, named as the stage module names it: the first name in the order
    runtime.materialize attaches modules and then attributes.
    """
    groups: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []   # per module, then per attribute
    for path in modules:
        mod = gm.get_submodule(path)
        held = shards[path].local_parameters(mod, tensor) if path in shards else \
            [(pname, tuple(p.shape), p.dtype, p.requires_grad) for pname, p in mod.named_parameters()]
        groups.append([(f"{path}.{pname}", shape, dtype) for pname, shape, dtype, trains in held if trains])
    for path in attributes:
        obj = gm
        for part in path.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, torch.nn.Parameter) and obj.requires_grad:
            shape = list(obj.shape)
            if path in param_shards:   # this rank's shard of it
                ps = param_shards[path]
                shape[ps.dim] = ps.split.local_size(tensor)
            groups.append([(path, tuple(shape), obj.dtype)])
    first: dict[str, str] = {}
    for name, _shape, _dtype in (x for grp in groups for x in grp):
        first.setdefault(canonical.get(name, name), name)
    out, seen = [], set()
    ordered = groups[:len(modules)][::-1] + groups[len(modules):][::-1]
    for name, shape, dtype in (x for grp in ordered for x in grp):
        key = canonical.get(name, name)
        if key in seen:
            continue
        seen.add(key)
        pad = next((ps for ps in padded if ps.name == first[key]), None)
        if pad is not None:   # rows padded at tensor degree 1 (Execution.vocab_multiple)
            shape = (pad.split.local_size(1), *shape[1:])
        out.append((first[key], shape, str(dtype).removeprefix("torch.")))
    return out


def _signature_of(gm: fx.GraphModule) -> str:
    return model_signature(gm)


def stage_imports(parts: list[StagePart]) -> list[str]:
    """Import lines for a file holding these stages' classes."""
    globs: dict = {}
    for p in parts:
        globs.update(p.globals)
    text = "\n".join(p.source for p in parts)
    used = {k: v for k, v in globs.items() if k.startswith("__import__") or re.search(rf"\b{re.escape(k)}\b", text)}
    lines = [ln for ln in import_block(used) if ln != "import torch"]
    lines.insert(0, "import torch")
    if any(p.spec.recompute == "full" for p in parts):
        lines.append("from torch.utils.checkpoint import checkpoint")
        lines.append("from runtime.recompute import keep_statistics")
    return lines


__all__ = ["Partition", "PartitionError", "StageCodeMaker", "StageCut", "StagePart", "cut_stages", "example_inputs",
           "partition", "stage_imports"]
