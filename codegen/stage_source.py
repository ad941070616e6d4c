"""The source of one stage class (codegen/partition.py cuts the graph; this writes each stage's code).

One method per layer (torch.fx's Python of the layer's nodes, with tensor-parallel local sizes), the
copies of a repeated block sharing one method under torch.compile, what the strategies change in a
layer written by their stage-code parts (codegen/stage_parts.py: sub-graph regions as calls of their
paths, spatial layers on image tiles), selective recomputation as Recompute modules, and a forward that
chains the layer methods (through torch.utils.checkpoint per layer under full recomputation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch.fx as fx

from codegen.pysrc import check_call_target, comment_text, doc_text, graph_method
from codegen.stage_parts import StageCodePart
from planner.graph.ops import op_base
from runtime.recompute import Recompute
from runtime.spec import Boundary


def ident(name: str) -> str:
    """`name` as a Python identifier (non-word characters to _, no leading digit)."""
    s = re.sub(r"\W", "_", name)
    return s if s and not s[0].isdigit() else f"_{s}"


def stage_source(g: fx.Graph, s: int, members: list[fx.Node], ins: list[Boundary], outs: list[Boundary],
                  is_last: bool, layer_of: dict[str, str], layer_order: list[str], recompute: str,
                  parts: Sequence[StageCodePart] = (), *, shared: bool = False,
                  gm: fx.GraphModule | None = None,
                  signatures: dict[str, str] | None = None) -> tuple[str, dict, dict[str, list[str]]]:
    """(the stage class, its globals, its layer methods -> the layers each runs): one method per layer and a
    forward chaining them
    (parts: the strategies' parts in its code, in order). shared: layers whose code is the same but for their own module (the
    copies of a repeated block) share one method, which takes the layer's module as `layer` (so that
    torch.compile of the method compiles once for every copy); `signatures` (layer -> ModelGraph's layer
    signature) keeps layers of different shapes or modules apart, whose code may read alike."""
    live = _Liveness.of(members, outs, layer_of, layer_order)
    writer = _StageWriter(live, recompute, tuple(parts), shared, gm, signatures)
    for i, L in enumerate(live.layers):
        writer.add_layer(i, L)
    return writer.finish(s, members, ins, outs, is_last)


@dataclass(frozen=True)
class _Liveness:
    """A stage's layers in model order, the nodes each runs, and how long each value lives: the index of
    the last layer that reads it (len(layers): the stage's end, its outputs and the model output)."""

    layers: list[str]
    members_by_layer: dict[str, list[fx.Node]]
    produced_in: dict[str, str]     # value -> the layer that makes it
    needed_after: dict[str, int]

    @classmethod
    def of(cls, members: list[fx.Node], outs: list[Boundary], layer_of: dict[str, str],
           layer_order: list[str]) -> "_Liveness":
        # layer methods run in model (layer) order; a layer's inputs come from earlier layers or the stage's
        # inputs; parameters read directly (get_attr) are fetched again in every layer method that reads them
        present = {layer_of[n.name] for n in members if n.op not in ("placeholder", "get_attr")}
        layers = [L for L in layer_order if L in present]
        computed = [n for n in members if n.op not in ("placeholder", "output", "get_attr")]
        members_by_layer = {L: [n for n in computed if layer_of[n.name] == L] for L in layers}
        produced_in = {n.name: layer_of[n.name] for n in computed}
        layer_idx = {L: i for i, L in enumerate(layers)}
        needed_after: dict[str, int] = {}
        for n in members:
            if n.op in ("placeholder", "get_attr"):
                continue
            reader = len(layers) if n.op == "output" else layer_idx[layer_of[n.name]]
            for a in n.all_input_nodes:
                if a.op != "get_attr":
                    needed_after[a.name] = max(needed_after.get(a.name, -1), reader)
        for b in outs:
            needed_after[b.name] = len(layers)
        return cls(layers, members_by_layer, produced_in, needed_after)


class _StageWriter:
    """Writes one stage class, a layer at a time (`add_layer`), then the class (`finish`)."""

    def __init__(self, live: _Liveness, recompute: str, parts: tuple[StageCodePart, ...],
                 shared: bool, gm: fx.GraphModule | None, signatures: dict[str, str] | None) -> None:
        self.live, self.recompute, self.parts = live, recompute, parts
        self.shared, self.gm, self.signatures = shared, gm, signatures
        self.methods: list[str] = []
        self.globs: dict = {}
        self.calls: list[str] = []
        self.inits: list[str] = []
        self.extra_imports: list[str] = []
        self.used_names: set[str] = set()
        self.generic: dict[str, tuple[str, int]] = {}   # shared: a method's code (comments aside) -> (name, index)
        self.served: dict[str, list[str]] = {}          # shared: method -> the layers it runs

    def add_layer(self, i: int, L: str) -> None:
        """Layer `L` (the i-th of the stage): its method (or an earlier layer's same code) and its call."""
        live = self.live
        body = live.members_by_layer[L]
        if not body:
            return
        changing = tuple(p for p in self.parts if p.layer(L, body))   # the strategies that change this layer
        lg, env, inputs = self._layer_graph(L, body, changing)
        outputs = [n.name for n in body if live.needed_after.get(n.name, -1) > i]
        if len(outputs) == 1:
            lg.output(env[outputs[0]])
        else:
            lg.output(tuple(env[o] for o in outputs))
        plain = self.shared and not changing
        method, root = self._add_method(L, lg, plain)
        args = ([_module_expr(root)] if root is not None else []) + inputs
        call = f"self.{method}({', '.join(args)})"
        if self.recompute == "full" and inputs:   # (a layer with no inputs has nothing to recompute from)
            call = f"checkpoint(self.{method}, {', '.join(args)}, use_reentrant=False, " \
                   "context_fn=keep_statistics(self))"
        self.calls.append(f"        {', '.join(outputs)} = {call}" if outputs else f"        {call}")
        for p in self.parts:
            self.calls += p.after(i, live.layers, live.produced_in, live.needed_after)

    def _layer_graph(self, L: str, body: list[fx.Node],
                     changing: tuple[StageCodePart, ...]) -> tuple[fx.Graph, dict[str, fx.Node], list[str]]:
        """The graph of layer `L`'s method (its nodes, as the strategies in `changing` write or rewrite them,
        selective recompute marks; no output yet), its node of each value by name, and its inputs: the
        values it reads from earlier layers or the stage's inputs."""
        lg = fx.Graph()
        env: dict[str, fx.Node] = {}
        inputs: list[str] = []
        produced_in = self.live.produced_in

        def need(a: str) -> None:   # a value a strategy's code reads: an input unless this layer made it
            if a not in env and produced_in.get(a) != L:
                env[a] = lg.placeholder(a)
                inputs.append(a)

        def arg(x: fx.Node) -> fx.Node:
            return env[x.name]

        for n in body:
            writer = next((p for p in changing if p.writes(n.name)), None)
            if writer is not None:
                self.globs.update(writer.write(n.name, lg, env, need))
                continue
            for a in n.all_input_nodes:
                if a.name in env:
                    continue
                if a.op == "get_attr":
                    env[a.name] = lg.node_copy(a)
                elif produced_in.get(a.name) != L:
                    env[a.name] = lg.placeholder(a.name)
                    inputs.append(a.name)
            made = next((c for p in changing if (c := p.copy(lg, n, arg)) is not None), None)
            env[n.name] = made if made is not None else lg.node_copy(n, arg)
            if self.recompute == "selective" and _recomputed(n):
                self._mark_recomputed(n, env[n.name])
        return lg, env, inputs

    def _mark_recomputed(self, n: fx.Node, c: fx.Node) -> None:
        """Selective recomputation: the copy `c` of `n` becomes a call of a Recompute module, named later."""
        if n.op == "call_function":
            qual = fx.node._get_qualified_name(n.target)
            mod = qual.rsplit(".", 1)[0]
            if not mod.startswith("torch"):
                self.extra_imports.append(f"import {mod}")
            made = f"Recompute({qual})"
        else:
            made = f"Recompute(method={n.target!r})"
        c.op, c.target = "call_module", _RECOMPUTE   # named below, once the node's name is final
        c.meta[_RECOMPUTE] = made

    def _add_method(self, L: str, lg: fx.Graph, plain: bool) -> tuple[str, str | None]:
        """Layer L's method (or, where shared, an earlier layer's of the same code): (its name, the module
        path passed as its `layer` argument, or None)."""
        method = "layer_" + ident(L)
        while method in self.used_names:
            method += "_"
        # a repeated layer's module is an argument of its method (so that its copies can share it)
        signatures = self.signatures
        repeats = signatures is not None and list(signatures.values()).count(signatures.get(L)) > 1
        root = _layer_root(self.gm, L, lg) if plain and repeats else None
        if plain:
            lg = _canonical_names(lg, root)
        for c in lg.nodes:   # selective recomputation: the stage's Recompute module of this call
            if c.op == "call_module" and c.target == _RECOMPUTE:
                attr = f"recompute_{c.name}"
                line = f"        self.{attr} = {c.meta[_RECOMPUTE]}"
                if line not in self.inits:
                    self.inits.append(line)
                c.target = attr
        src, gl = graph_method(lg, method)
        if root is not None:   # the layer's own module is the method's `layer` argument
            src = re.sub(rf"\bself\.{_LAYER}\b", "layer", src)
            src = re.sub(rf"def {method}\(self(, |\))", lambda m: f"def {method}(self, layer{m.group(1)}", src,
                         count=1)
        self.globs.update(gl)
        key = (signatures or {}).get(L, L) + "\n" + \
            "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith("#")).replace(method, "@")
        if plain and key in self.generic:
            method = self.generic[key][0]   # the same code as an earlier layer's
        else:
            self.used_names.add(method)
            if plain:
                self.generic[key] = (method, len(self.methods))
            self.methods.append(f"    # ---- layer {comment_text(L)} ----\n" + src)  # L: the model's module path
        self.served.setdefault(method, []).append(L)
        return method, root

    def finish(self, s: int, members: list[fx.Node], ins: list[Boundary], outs: list[Boundary],
               is_last: bool) -> tuple[str, dict, dict[str, list[str]]]:
        """(the stage class's source, its globals, method -> layers it runs)."""
        methods, globs, inits = list(self.methods), self.globs, self.inits
        for p in self.parts:   # e.g. the regions' methods and the contexts the strategies' code reads
            more, lines, gl = p.finish()
            methods += more
            inits += lines
            globs.update(gl)
        args = ", ".join(["self"] + [b.name for b in ins])
        if is_last:
            ret_src = _render_output(next(n for n in members if n.op == "output").args[0])
        else:
            ret_src = "(" + ", ".join(b.name for b in outs) + ("," if len(outs) == 1 else "") + ")"
        forward = [f"    def forward({args}):"] + self.calls + [f"        return {ret_src}"]
        init = ""
        if inits:
            init = "    def __init__(self):\n        super().__init__()\n" + "\n".join(inits) + "\n\n"
            globs["Recompute"] = Recompute
            for line in self.extra_imports:
                globs[f"__import__{line}"] = line
        for name, k in self.generic.values():   # a shared method names every layer it runs
            if len(self.served[name]) > 1:
                methods[k] = methods[k].replace(
                    f"    # ---- layer {comment_text(self.served[name][0])} ----\n",
                    f"    # ---- layers {', '.join(comment_text(x) for x in self.served[name])}: one method, each "
                    "layer's module passed as `layer` ----\n", 1)
        doc = _stage_doc(s, self.live.layers, ins, outs, is_last)
        cls = f"class Stage{s}(torch.nn.Module):\n{doc}\n" + init + "\n".join(forward) + "\n\n" + "\n".join(methods)
        return cls, globs, self.served


def _stage_doc(s: int, layers: list[str], ins: list[Boundary], outs: list[Boundary], is_last: bool) -> str:
    """The stage class's docstring: its layers, inputs and outputs (this rank's shapes)."""
    if not layers:
        return '    """An empty stage."""\n'
    return (f'    """Stage {s}: layers {doc_text(layers[0])} .. {doc_text(layers[-1])}.\n\n'
            f'    Inputs (one micro-batch, this rank\'s shapes): '
            + ", ".join(f"{b.name} {list(b.shape)} {b.dtype}{' (data)' if b.source == 'data' else ''}" for b in ins)
            + ".\n    Returns: "
            + ("the model output." if is_last else ", ".join(f"{b.name} {list(b.shape)}" for b in outs) + ".")
            + '\n    """\n')


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
    strip = ident(root) + "_" if root else None
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
    check_call_target(path)
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


__all__ = ["ident", "stage_source"]
