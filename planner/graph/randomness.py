"""Where a model draws random numbers in training (dropout with p > 0, attention dropout, random ops).

A parallel run cannot equal the single-process run sample by sample where the model draws random
numbers: every rank draws its own. `meshplan run --verify` (runtime/verify/__init__.py) says so instead of
reporting a mismatch, from the list capture records in the graph (ModelGraph.random_ops). Three
sources feed it, so that randomness inside a module capture keeps whole is found too:

- the graph's nodes: a functional dropout or an ATen dropout with p > 0, attention with dropout_p > 0,
  and random ops (`rand`, `bernoulli`, ...), by the op's name;
- leaf modules' settings: capture keeps torch.nn modules whole (nn.TransformerEncoderLayer,
  nn.MultiheadAttention, nn.Dropout), so their submodules are read: dropout modules with p > 0,
  attention with dropout > 0, RReLU, recurrent layers with dropout between layers;
- the op stream: every ATen op a node dispatches while capture runs it (SeededOps, a dispatch mode),
  whose schema carries PyTorch's `nondeterministic_seeded` tag (it draws from the generator).

Each entry reads "<module path or node> (<what>)", for example "encoder.layers.0.dropout1 (dropout p=0.1)".
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from planner.graph.model import OpInfo
from runtime.vocab import OpKind

# ops that draw random numbers, by base name (fx functional calls and ATen ops of export graphs)
_RANDOM = ("bernoulli", "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
           "multinomial", "normal", "uniform", "native_dropout", "rrelu", "rrelu_with_noise")


def node_random_ops(n: OpInfo) -> list[str]:
    """The random draws one graph node names itself (empty for a leaf module: see module_random_ops)."""
    base = n.target.rsplit(".", 1)[-1].lower().rstrip("_")
    where = n.module_path or n.name
    p = n.attr("p", n.attr("arg1"))
    if "dropout" in base and base != "native_dropout":
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
            return [f"{where} (dropout p={p})"]
        return []
    if base in _RANDOM:
        return [f"{where} ({base})"]
    if n.kind == OpKind.ATTENTION and isinstance(n.attr("dropout_p"), float) and n.attr("dropout_p") > 0:
        return [f"{where} (attention dropout p={n.attr('dropout_p')})"]
    return []


def module_random_ops(module: nn.Module, path: str) -> list[str]:
    """The random draws of a leaf module and its submodules in training, read from their settings."""
    out = []
    for sub_path, m in module.named_modules(prefix=path):
        where = sub_path or "<root>"
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            out.append(f"{where} ({type(m).__name__.lower()} p={m.p})" if type(m) is not nn.Dropout
                       else f"{where} (dropout p={m.p})")
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            out.append(f"{where} (attention dropout p={m.dropout})")
        elif isinstance(m, nn.RReLU):
            out.append(f"{where} (rrelu)")
        elif isinstance(m, nn.RNNBase) and m.dropout > 0 and m.num_layers > 1:
            out.append(f"{where} (dropout between layers p={m.dropout})")
    return out


class SeededOps(TorchDispatchMode):
    """Records the ATen ops that draw random numbers (PyTorch's `nondeterministic_seeded` tag) while
    it is active; `take()` returns those since the last take, by base name."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs or {}):
            self._seen.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))

    def take(self) -> tuple[str, ...]:
        seen, self._seen = tuple(dict.fromkeys(self._seen)), []
        return seen


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether a seeded op draws anything here: not a dropout with train=False or p == 0."""
    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, args), **kwargs)
    if values.get("train") is False:
        return False
    p = values.get("p", values.get("dropout_p"))
    return not (isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0 and "dropout" in func.__name__)


def random_ops(nodes: Iterable[OpInfo], leaf_modules: dict[str, nn.Module], streams: dict[str, tuple[str, ...]]
               ) -> tuple[str, ...]:
    """Every place the model draws random numbers in training (see the module docstring), in graph order.

    leaf_modules: node name -> the leaf module a call_module node runs; streams: node name -> the
    seeded ATen ops it dispatched when capture ran it."""
    out: list[str] = []
    for n in nodes:
        found = node_random_ops(n)
        if n.name in leaf_modules:
            found += module_random_ops(leaf_modules[n.name], n.module_path or n.name)
        if not found and streams.get(n.name):
            found = [f"{n.module_path or n.name} ({', '.join(streams[n.name])})"]
        out += found
    return tuple(dict.fromkeys(out))


__all__ = ["SeededOps", "module_random_ops", "node_random_ops", "random_ops"]
