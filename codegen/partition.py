"""`codegen.partition`: cut the fx graph into per-stage modules, split for tensor parallelism.

For each pipeline stage of a Plan:

* its nodes are the nodes of its layers; its inputs are the model inputs its
  layers read (from the data) and every value made by an earlier stage that
  this or a later stage reads (from the previous stage, passed along when a
  later stage needs it); its outputs are the next stage's received inputs;
* its code is one method per layer (torch.fx's Python, with tensor-parallel
  local sizes) and a forward that chains them (through
  torch.utils.checkpoint per layer when the plan recomputes); the layers of a
  spatial part run on image tiles (codegen/strategies/spatial/tiles.py), the paths of a
  sub-graph region on their sub-grids (codegen/strategies/subgraph/regions.py);
* its `StageSpec` lists the local shape of every boundary tensor for one
  micro-batch, the modules its code calls and how each is split.

Everything is decided here, once, from the graph and the plan; a rank only
builds the modules and runs the code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from codegen.head import find_head, fuse, narrow_logits, output_head, pad_splits, padded_rows, vocab_split
from codegen.pysrc import check_target, comment_text, doc_text, graph_method, import_block
from codegen.strategies.spatial.tiles import StageTiles, TileRewrite
from codegen.strategies.subgraph.regions import (insert_region_call, layer_regions, region_code, region_inputs, region_methods,
                              skipped_nodes, subgraph_init)
from codegen.strategies.tensor.split import TensorSplitError, apply_splits
from planner.binding import graph_mismatch
from planner.graph.model import ModelGraph
from planner.graph.ops import module_path_of, op_base
from planner.plan import Plan
from planner.strategies.tensor.split.analysis import tensor_splits
from runtime.materialize import RUNTIME_ATTRS, model_signature
from runtime.recompute import Recompute
from runtime.parallel.spatial.geometry import SpatialSpec
from runtime.spec import Boundary, StageSpec
from runtime.parallel.tensor.layers import shard_module


GraphRewrite = Callable[[fx.GraphModule, dict[str, Any]], tuple[fx.Graph, dict[str, Any]]]


class PartitionError(ValueError):
    """The plan cannot be cut into stage modules; the message names the layer or value."""


@dataclass(frozen=True)
class StagePart:
    """One stage: its runtime spec, generated class, and local parameters.

    params: (name, local shape, dtype) of the stage module's trainable parameters, in
    the order gradients become ready in backward (last layer first).
    """

    spec: StageSpec
    device_index: int
    class_name: str
    source: str
    globals: dict
    params: tuple[tuple[str, tuple[int, ...], str], ...]


@dataclass(frozen=True)
class Partition:
    stages: tuple[StagePart, ...]
    tensor: int
    micro_batch_size: int
    signature: str
    tensor_shapes: dict          # model tensor name -> full shape (for mismatch messages)


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


def _ident(name: str) -> str:
    s = re.sub(r"\W", "_", name)
    return s if s and not s[0].isdigit() else f"_{s}"


def partition(plan: Plan, graph: ModelGraph, *, spatial: SpatialSpec | None = None,
              rewrite: GraphRewrite | None = None) -> Partition:
    """Per-stage modules for `plan` (see module docstring).

    spatial: the images' tiles (codegen/strategies/spatial/program.py): the layers up to the one holding node
    `spatial.until` run on them, in the stage that holds that node. rewrite(gm, inputs): a
    strategy's rewrite of the captured graph before the tensor-parallel split, and the meta
    stand-ins of the runtime attributes it reads (context parallelism: codegen/strategies/context/stage_code.py).

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
    t, mb = cfg.tensor, cfg.micro_batch_size
    splits = plan.tensor_splits
    if splits is None and t > 1:   # a version-1 plan: decide the split as the planner does now
        splits = tensor_splits(graph, dict(plan.shardings), t, cfg.sequence_parallel)
    if splits is not None and splits.tensor != t:
        raise PartitionError(f"the plan's tensor-parallel split is for tensor {splits.tensor}, its config has "
                             f"tensor {t}; make the plan again")
    if splits is not None and (splits.sequence is not None) != cfg.sequence_parallel:
        raise PartitionError(f"the plan's tensor-parallel split is {'with' if splits.sequence else 'without'} "
                             f"sequence parallelism, its config has sequence_parallel={cfg.sequence_parallel}; "
                             "make the plan again")
    inputs = example_inputs(graph, mb)
    rewritten, attrs = rewrite(gm, inputs) if rewrite is not None else (None, None)
    ex = plan.execution
    if ex.chunked or ex.vocab_multiple > 1:   # the output layer (codegen/head.py)
        site, why = find_head(rewritten if rewritten is not None else gm.graph, gm)
        if site is None:
            flag = "--loss-impl chunked" if ex.chunked else f"--vocab-multiple {ex.vocab_multiple}"
            raise PartitionError(f"{flag} needs a model whose output is a final linear layer's, but {why}; "
                                 f"leave {flag.split()[0]} out")
        if t > 1 and ex.vocab_multiple > 1:
            vsplit = vocab_split(splits, site)
            if vsplit is None:
                raise PartitionError(f"--vocab-multiple {ex.vocab_multiple} at tensor {t}: the plan does not split "
                                     f"the output layer ({site.weight}) over the vocabulary, so nothing pads it; "
                                     "leave --vocab-multiple out")
            splits = pad_splits(splits, vsplit, ex.vocab_multiple)
    res = apply_splits(gm, splits, inputs, graph=rewritten, attrs=attrs)
    g = res.graph
    head, head_extra, padded_names = _output_layer(g, gm, graph, res, ex, t, plan)
    signatures = [L.signature for L in graph.layers]
    repeated = {L.name for L in graph.layers if signatures.count(L.signature) > 1}
    weighty = {L.name for L in graph.layers if L.param_count > 0}
    blocks = repeated & weighty
    nodes = [n for n in g.nodes]
    pos = {n.name: i for i, n in enumerate(nodes)}

    # ---- which stage and layer each node belongs to --------------------------
    layer_of: dict[str, str] = {}
    for layer in graph.layers:
        for name in layer.nodes:
            layer_of[name] = layer.name
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
    num_stages = len(plan.stages)
    # A parameter or buffer read directly (get_attr) belongs to no stage: every stage that
    # reads it holds it (a weight shared by two stages is held by both; runtime/execute/ties.py
    # keeps the copies equal).
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
    last_use = {n.name: max((stage_of[u.name] for u in n.users), default=-1) for n in nodes if n.op != "get_attr"}
    lv, fv = res.local_values, res.full_values

    def boundary(n: fx.Node, source: str, data_index: int = -1) -> Boundary:
        name = n.name
        v = lv[name]
        if not isinstance(v, torch.Tensor):
            raise PartitionError(f"value {name!r} ({type(v).__name__}) crosses a pipeline cut; only tensors can "
                                 "be sent between stages. Choose other stage boundaries.")
        key = str(n.target).lstrip("*") if source == "data" else ""
        return Boundary(name, tuple(v.shape), str(v.dtype).removeprefix("torch."),
                        bool(fv[name].requires_grad and v.is_floating_point()), source, data_index, key)

    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    crossing = {s: [n for n in nodes if n.op not in ("output", "get_attr") and stage_of[n.name] < s <= last_use[n.name]]
                for s in range(num_stages)}
    local_mods = {}
    for path, sh in res.shards.items():
        local_mods[path] = shard_module(gm.get_submodule(path), sh, 0, t, None)
    canonical = shared_names(graph)

    codes = region_code(plan.subgraph, lv) if plan.subgraph else []
    tiles = _stage_tiles(spatial, gm, lv, layer_of, stage_of, stage_of_layer, known)
    parts = []
    for st in sorted(plan.stages, key=lambda s: s.index):
        s = st.index
        own = [n for n in nodes if n.op != "get_attr" and stage_of[n.name] == s]
        read = {a.name for n in own for a in n.all_input_nodes if a.op == "get_attr"}
        members = [n for n in nodes if (n.op != "get_attr" and stage_of[n.name] == s) or n.name in read]
        data_in = [boundary(n, "data", placeholders.index(n.name)) for n in members if n.op == "placeholder"]
        recv_in = [boundary(v, "recv") for v in crossing[s]]
        ins = sorted(data_in + recv_in, key=lambda b: pos[b.name])
        is_last = s == num_stages - 1
        outs = [] if is_last else [boundary(v, "recv") for v in crossing[s + 1]]
        for k, b in enumerate(outs):
            outs[k] = Boundary(b.name, b.shape, b.dtype, b.requires_grad, "send")
        modules = tuple(dict.fromkeys(str(n.target) for n in members if n.op == "call_module"))
        attributes = tuple(dict.fromkeys(str(n.target) for n in members
                                         if n.op == "get_attr" and n.target not in RUNTIME_ATTRS))
        if is_last:   # a fused output layer: its tensors are held, though no code calls it
            modules = tuple(dict.fromkeys(modules + head_extra[0]))
            attributes = tuple(dict.fromkeys(attributes + head_extra[1]))
        source, globs, served = _stage_source(g, s, members, ins, outs, is_last, layer_of, known, cfg.recompute,
                                              codes, tiles.get(s), shared=ex.compile, gm=gm,
                                              signatures={L.name: L.signature for L in graph.layers})
        # regional compilation: the methods of the repeated blocks (one per distinct block); in a model without
        # repeated blocks, those of the layers that hold parameters (a few views or an activation alone: never)
        compiled = tuple(m for m, ls in served.items() if any(L in (blocks or weighty) for L in ls))
        if ex.whole_stage:   # the stage's whole forward, one compiled function (runtime/execution.py CompileScope)
            compiled = ("forward",)
        padded = _padded(padded_names, modules, attributes, ex.vocab_multiple, head)
        params = _stage_params(gm, modules, attributes, local_mods, canonical, res.param_shards, t, padded)
        held = {canonical.get(name, name) for name, _, _ in params}
        shared = tuple(grp for grp in graph.shared_params if grp[0] in held)
        spec = StageSpec(index=s, layers=st.layers, inputs=tuple(ins), outputs=tuple(outs), modules=modules,
                         attributes=attributes, shards=tuple(res.shards[m] for m in modules if m in res.shards),
                         is_last=is_last, output_split=res.output_split if is_last else None,
                         recompute=cfg.recompute, shared=shared,
                         param_shards=tuple(res.param_shards[a] for a in attributes if a in res.param_shards),
                         running_stats=_running_stats(g, gm, members), head=head if is_last else None,
                         padded=padded, compiled=compiled if ex.compile else ())
        parts.append(StagePart(spec, st.device_index, f"Stage{s}", source, globs, tuple(params)))
    sd = gm.state_dict(keep_vars=True)
    return Partition(tuple(parts), t, mb, _signature_of(gm), {k: list(v.shape) for k, v in sd.items()})


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


def _stage_tiles(spatial: SpatialSpec | None, gm: fx.GraphModule, lv: dict, layer_of: dict[str, str],
                 stage_of: dict[str, int], stage_of_layer: dict[str, int], known: list[str]) -> dict[int, StageTiles]:
    """stage -> its spatial part: the stage holding node `spatial.until` runs its layers up to that
    node's layer on image tiles (codegen/strategies/spatial/tiles.py)."""
    if spatial is None or spatial.until is None:
        return {}
    if spatial.until not in stage_of:
        raise PartitionError(f"the spatial part ends at node {spatial.until!r}, which is not a node of the model")
    s = stage_of[spatial.until]
    last = known.index(layer_of[spatial.until])
    layers = frozenset(L for L in known[:last + 1] if stage_of_layer[L] == s)

    def shape_of(name: str) -> tuple[int, ...] | None:
        v = lv.get(name)
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    return {s: StageTiles(layers, spatial.batchnorm, TileRewrite(spatial.degree, spatial.split, gm.get_submodule,
                                                                 shape_of))}


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


def _stage_params(gm: fx.GraphModule, modules: tuple[str, ...], attributes: tuple[str, ...], local_mods: dict,
                  canonical: dict[str, str], param_shards: dict, tensor: int,
                  padded: tuple = ()) -> list[tuple[str, tuple[int, ...], str]]:
    """The stage module's trainable parameters (name, local shape, dtype), in the order gradients
    become ready in backward (last module first).

    A parameter the stage reaches under several names (a tied weight whose two users are both
    here) is one parameter, named as the stage module names it: the first name in the order
    runtime.materialize attaches modules and then attributes.
    """
    groups: list[list[tuple[str, torch.Tensor]]] = []   # per module, then per attribute
    for path in modules:
        mod = local_mods[path] if path in local_mods else gm.get_submodule(path)
        groups.append([(f"{path}.{pname}", p) for pname, p in mod.named_parameters() if p.requires_grad])
    for path in attributes:
        obj = gm
        for part in path.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, torch.nn.Parameter) and obj.requires_grad:
            if path in param_shards:   # this rank's shard of it
                ps = param_shards[path]
                shape = list(obj.shape)
                shape[ps.dim] = ps.split.local_size(tensor)
                obj = torch.empty(shape, dtype=obj.dtype, device="meta")
            groups.append([(path, obj)])
    first: dict[str, str] = {}
    for name, _p in (x for grp in groups for x in grp):
        first.setdefault(canonical.get(name, name), name)
    out, seen = [], set()
    ordered = groups[:len(modules)][::-1] + groups[len(modules):][::-1]
    for name, p in (x for grp in ordered for x in grp):
        key = canonical.get(name, name)
        if key in seen:
            continue
        seen.add(key)
        shape = tuple(p.shape)
        pad = next((ps for ps in padded if ps.name == first[key]), None)
        if pad is not None:   # rows padded at tensor degree 1 (Execution.vocab_multiple)
            shape = (pad.split.local_size(1), *shape[1:])
        out.append((first[key], shape, str(p.dtype).removeprefix("torch.")))
    return out


def _signature_of(gm: fx.GraphModule) -> str:
    return model_signature(gm)


def _stage_source(g: fx.Graph, s: int, members: list[fx.Node], ins: list[Boundary], outs: list[Boundary],
                  is_last: bool, layer_of: dict[str, str], layer_order: list[str], recompute: str,
                  codes: list | None = None, tiles: StageTiles | None = None, *, shared: bool = False,
                  gm: fx.GraphModule | None = None,
                  signatures: dict[str, str] | None = None) -> tuple[str, dict, dict[str, list[str]]]:
    """(the stage class, its globals, its layer methods -> the layers each runs): one method per layer and a
    forward chaining them
    (tiles: its spatial part). shared: layers whose code is the same but for their own module (the
    copies of a repeated block) share one method, which takes the layer's module as `layer` (so that
    torch.compile of the method compiles once for every copy); `signatures` (layer -> ModelGraph's layer
    signature) keeps layers of different shapes or modules apart, whose code may read alike."""
    # layer methods run in model (layer) order; a layer's inputs come from earlier layers or the stage's inputs
    present = {layer_of[n.name] for n in members if n.op not in ("placeholder", "get_attr")}
    layers: list[str] = [L for L in layer_order if L in present]
    out_node = next((n for n in members if n.op == "output"), None)
    stage_outputs = {b.name for b in outs}
    # values read after each layer (by later layers of this stage, the stage's outputs, the model output)
    # parameters read directly (get_attr) are fetched again in every layer method that reads them
    members_by_layer = {L: [n for n in members if n.op not in ("placeholder", "output", "get_attr")
                            and layer_of[n.name] == L] for L in layers}
    produced_in = {n.name: layer_of[n.name] for n in members if n.op not in ("placeholder", "output", "get_attr")}
    layer_idx = {L: i for i, L in enumerate(layers)}
    needed_after: dict[str, int] = {}   # value -> index of the last layer that reads it (len(layers) = stage end)
    for n in members:
        if n.op in ("placeholder", "get_attr"):
            continue
        reader = len(layers) if n.op == "output" else layer_idx[layer_of[n.name]]
        for a in n.all_input_nodes:
            if a.op != "get_attr":
                needed_after[a.name] = max(needed_after.get(a.name, -1), reader)
    for name in stage_outputs:
        needed_after[name] = len(layers)
    methods, globs, calls = [], {}, []
    inits: list[str] = []
    extra_imports: list[str] = []
    used_names: set[str] = set()
    node_by_name = {n.name: n for n in g.nodes}
    region_src: list[str] = []
    owners: dict[str, int] = {}
    generic: dict[str, tuple[str, int]] = {}   # shared: a method's code (comments aside) -> (name, its index)
    served: dict[str, list[str]] = {}          # shared: method -> the layers it runs
    for i, L in enumerate(layers):
        body = members_by_layer[L]
        if not body:
            continue
        lg = fx.Graph()
        env: dict[str, fx.Node] = {}
        inputs = []
        regs = layer_regions(codes or [], L, body)   # sub-graph parallelism: codegen/strategies/subgraph/regions.py
        skip = skipped_nodes(regs)
        tiled = tiles is not None and L in tiles.layers   # spatial parallelism: codegen/strategies/spatial/tiles.py
        for n in body:
            if n.name in skip:
                code = regs.get(n.name)
                if code is not None:
                    for a in region_inputs(code, node_by_name):
                        if a not in env and produced_in.get(a) != L:
                            env[a] = lg.placeholder(a)
                            inputs.append(a)
                    insert_region_call(lg, env, code, node_by_name)
                    src, gl, own = region_methods(code, node_by_name)
                    region_src += src
                    globs.update(gl)
                    owners.update(own)
                continue
            for a in n.all_input_nodes:
                if a.name in env:
                    continue
                if a.op == "get_attr":
                    env[a.name] = lg.node_copy(a)
                elif produced_in.get(a.name) != L:
                    env[a.name] = lg.placeholder(a.name)
                    inputs.append(a.name)
            env[n.name] = tiles.rewrite.node(lg, n, lambda x: env[x.name]) if tiled else \
                lg.node_copy(n, lambda x: env[x.name])
            if recompute == "selective" and _recomputed(n):
                c = env[n.name]
                if n.op == "call_function":
                    qual = fx.node._get_qualified_name(n.target)
                    mod = qual.rsplit(".", 1)[0]
                    if not mod.startswith("torch"):
                        extra_imports.append(f"import {mod}")
                    made = f"Recompute({qual})"
                else:
                    made = f"Recompute(method={n.target!r})"
                c.op, c.target = "call_module", _RECOMPUTE   # named below, once the node's name is final
                c.meta[_RECOMPUTE] = made
        outputs = [n.name for n in body if needed_after.get(n.name, -1) > i]
        if len(outputs) == 1:
            lg.output(env[outputs[0]])
        else:
            lg.output(tuple(env[o] for o in outputs))
        method = "layer_" + _ident(L)
        while method in used_names:
            method += "_"
        # a repeated layer's module is an argument of its method (so that its copies can share it)
        repeats = signatures is not None and list(signatures.values()).count(signatures.get(L)) > 1
        root = _layer_root(gm, L, lg) if shared and repeats and not regs and not tiled else None
        if shared and not regs and not tiled:
            lg = _canonical_names(lg, root)
        for c in lg.nodes:   # selective recomputation: the stage's Recompute module of this call
            if c.op == "call_module" and c.target == _RECOMPUTE:
                attr = f"recompute_{c.name}"
                line = f"        self.{attr} = {c.meta[_RECOMPUTE]}"
                if line not in inits:
                    inits.append(line)
                c.target = attr
        src, gl = graph_method(lg, method)
        if root is not None:   # the layer's own module is the method's `layer` argument
            src = re.sub(rf"\bself\.{_LAYER}\b", "layer", src)
            src = re.sub(rf"def {method}\(self(, |\))", lambda m: f"def {method}(self, layer{m.group(1)}", src,
                         count=1)
        globs.update(gl)
        key = (signatures or {}).get(L, L) + "\n" + \
            "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith("#")).replace(method, "@")
        if shared and not regs and not tiled and key in generic:
            method = generic[key][0]   # the same code as an earlier layer's
        else:
            used_names.add(method)
            if shared and not regs and not tiled:
                generic[key] = (method, len(methods))
            methods.append(f"    # ---- layer {comment_text(L)} ----\n" + src)  # L: the model's module path
        served.setdefault(method, []).append(L)
        lhs = ", ".join(outputs)
        args = ([_module_expr(root)] if root is not None else []) + inputs
        call = f"self.{method}({', '.join(args)})"
        if recompute == "full" and inputs:   # (a layer with no inputs has nothing to recompute from)
            call = f"checkpoint(self.{method}, {', '.join(args)}, use_reentrant=False, " \
                   "context_fn=keep_statistics(self))"
        calls.append(f"        {lhs} = {call}" if outputs else f"        {call}")
        if tiled and not any(x in tiles.layers for x in layers[i + 1:]):   # the end of the spatial part
            calls += tiles.gather_lines(produced_in, needed_after, i)
    methods += region_src
    if region_src:   # the stage splits something: it needs its SubgraphContext
        line, gl = subgraph_init(owners)
        inits.append(line)
        globs.update(gl)
    if tiles is not None:   # the stage runs on image tiles: it needs its SpatialContext
        line, gl = tiles.init_line()
        inits.append(line)
        globs.update(gl)
    args = ", ".join(["self"] + [b.name for b in ins])
    if is_last:
        ret = out_node.args[0]
        ret_src = _render_output(ret)
    else:
        ret_src = "(" + ", ".join(b.name for b in outs) + ("," if len(outs) == 1 else "") + ")"
    forward = [f"    def forward({args}):"] + calls + [f"        return {ret_src}"]
    doc = (f'    """Stage {s}: layers {doc_text(layers[0])} .. {doc_text(layers[-1])}.\n\n'
           f'    Inputs (one micro-batch, this rank\'s shapes): '
           + ", ".join(f"{b.name} {list(b.shape)} {b.dtype}{' (data)' if b.source == 'data' else ''}" for b in ins)
           + ".\n    Returns: "
           + ("the model output." if is_last else ", ".join(f"{b.name} {list(b.shape)}" for b in outs) + ".")
           + '\n    """\n') if layers else '    """An empty stage."""\n'
    init = ""
    if inits:
        init = "    def __init__(self):\n        super().__init__()\n" + "\n".join(inits) + "\n\n"
        globs["Recompute"] = Recompute
        for line in extra_imports:
            globs[f"__import__{line}"] = line
    for name, k in generic.values():   # a shared method names every layer it runs
        if len(served[name]) > 1:
            methods[k] = methods[k].replace(
                f"    # ---- layer {comment_text(served[name][0])} ----\n",
                f"    # ---- layers {', '.join(comment_text(x) for x in served[name])}: one method, each layer's "
                "module passed as `layer` ----\n", 1)
    cls = f"class Stage{s}(torch.nn.Module):\n{doc}\n" + init + "\n".join(forward) + "\n\n" + "\n".join(methods)
    return cls, globs, served


# The stand-in root of a shared layer method's module paths, written `layer` in its source.
_LAYER = "_meshplan_layer_"
# The stand-in target of a selectively recomputed call until its Recompute module is named.
_RECOMPUTE = "_meshplan_recompute_"


def _layer_root(gm: fx.GraphModule | None, path: str, lg: fx.Graph) -> str | None:
    """`path` when it names a module of the model that holds what the layer graph `lg` calls and reads
    (its module paths then become relative to it: `layer.ln1` for `blocks.3.ln1`), else None."""
    if gm is None or not path or any(n.name == "layer" for n in lg.nodes):
        return None
    try:
        gm.get_submodule(path)
    except AttributeError:
        return None
    prefix = f"{path}."
    rooted = False
    for n in lg.nodes:
        if n.op in ("call_module", "get_attr") and isinstance(n.target, str) and n.target.startswith(prefix):
            n.target = f"{_LAYER}.{n.target[len(prefix):]}"
            rooted = True
        elif n.op == "call_module" and n.target == path:   # the layer is one module's call
            n.target = _LAYER
            rooted = True
    return path if rooted else None


def _canonical_names(lg: fx.Graph, root: str | None) -> fx.Graph:
    """A copy of the layer graph whose names read alike in two copies of a repeated block: its inputs
    `x`, `x_1`, ...; the layer's path left off the front of the others ("blocks_3_ln1" -> "ln1"), each
    numbered from its first use in the layer ("add_7", "add_8" -> "add", "add_1")."""
    strip = _ident(root) + "_" if root else None
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    counts: dict[str, int] = {}
    for n in lg.nodes:
        if n.op == "output":
            out.output(fx.node.map_arg(n.args[0], lambda a: env[a]))
            continue
        base = "x" if n.op == "placeholder" else n.name
        if strip and base.startswith(strip) and len(base) > len(strip):
            base = base[len(strip):]
        base = re.sub(r"_\d+$", "", base) or base
        k = counts.get(base, 0)
        counts[base] = k + 1
        name = base if k == 0 else f"{base}_{k}"
        if n.op == "placeholder":
            c = out.placeholder(name)
        else:
            c = out.create_node(n.op, n.target, fx.node.map_arg(n.args, lambda a: env[a]),
                                fx.node.map_arg(n.kwargs, lambda a: env[a]), name)
        c.meta = dict(n.meta)
        env[n] = c
    return out


def _module_expr(path: str) -> str:
    """Python for the stage's module at `path`, as torch.fx writes it (`getattr(self.blocks, "3")`)."""
    check_target(path)
    expr = "self"
    for part in path.split("."):
        expr = f"{expr}.{part}" if part.isidentifier() else f'getattr({expr}, "{part}")'
    return expr


_RECOMPUTED = ("scaled_dot_product_attention", "softmax", "_softmax", "_safe_softmax")


def _recomputed(n: fx.Node) -> bool:
    """The attention core selective recomputation drops: fused attention and softmax calls, and
    context parallelism's attention (`context.attention`, codegen/strategies/context/stage_code.py), exchange included."""
    if n.op == "call_function":
        return op_base(n.target) in _RECOMPUTED
    return n.op == "call_method" and n.target in (*_RECOMPUTED, "attention")


def _render_output(ret: Any) -> str:
    if isinstance(ret, fx.Node):
        return ret.name
    if isinstance(ret, (tuple, list)):
        inner = ", ".join(_render_output(r) for r in ret)
        return f"({inner},)" if isinstance(ret, tuple) and len(ret) == 1 else \
            (f"({inner})" if isinstance(ret, tuple) else f"[{inner}]")
    if isinstance(ret, dict):
        return "{" + ", ".join(f"{k!r}: {_render_output(v)}" for k, v in ret.items()) + "}"
    return repr(ret)


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


__all__ = ["Partition", "PartitionError", "StagePart", "TensorSplitError", "example_inputs", "partition",
           "stage_imports"]
