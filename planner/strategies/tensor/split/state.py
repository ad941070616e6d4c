"""The split of one value of an fx graph and the state of a tensor-split analysis
(planner/strategies/tensor/split/rules.py walks the graph, op_rules.py holds the rule of each op).

A `Split` names the dimension divided over the tensor ranks, its factors (a reshape may fold several
dimensions into one, or cut one into several) and which factor is divided, or none yet: a column op's
output stays undecided until a reshape or a meeting with a decided split fixes its partition. The
`_State` of one pass records those decisions (a union-find over the undecided origins), the choice
points a reshape offers (rules._search backtracks over them), the parameters' uses and the replicated
tensors that meet split ones. `_map_reshape` follows a split through a reshape, which both the function
rules and nn.Flatten need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runtime.program.shards import FeatureSplit, ShardError


class TensorSplitError(ShardError):
    """A tensor-parallel sharding that cannot be carried out; the message names the node, and
    `node` holds its fx name where one node is to blame (None otherwise)."""

    node: str | None = None


def norm_dim(d: int, ndim: int) -> int:
    """A non-negative dimension index for `d` in a tensor of `ndim` dimensions."""
    return d + ndim if d < 0 else d


@dataclass(frozen=True)
class Split:
    """How one value is split: dimension `dim`, whose full size is prod(factors) and
    whose factor `split` is divided over the ranks (None: not decided yet, then
    factors == (size,) and `origin` names the column op whose partition is pending)."""

    dim: int
    factors: tuple[int, ...]
    split: int | None
    origin: str | None = None

    @property
    def size(self) -> int:
        return math.prod(self.factors)


class _Fail(Exception):
    def __init__(self, node: str, msg: str):
        super().__init__(msg)
        self.node = node


@dataclass
class _State:
    t: int
    choices: dict[str, int]
    taken: list[tuple[str, int, int]] = field(default_factory=list)   # (node, chosen, candidates)
    param_uses: list[tuple[str, str, Any]] = field(default_factory=list)  # (ATen weight op, role, Split / rows)
    # a replicated tensor meeting a split one: (reading node, tensor, its dimension, the split it meets)
    scatters: list[tuple[str, str, int, Split]] = field(default_factory=list)
    decided: dict[str, FeatureSplit] = field(default_factory=dict)    # origin root -> partition
    parent: dict[str, str] = field(default_factory=dict)              # union-find of origins

    def root(self, o: str) -> str:
        while self.parent.get(o, o) != o:
            o = self.parent[o]
        return o

    def union(self, a: str, b: str) -> None:
        ra, rb = self.root(a), self.root(b)
        if ra != rb:
            self.parent[rb] = ra
            if rb in self.decided and ra not in self.decided:
                self.decided[ra] = self.decided.pop(rb)

    def choose(self, node: str, candidates: int) -> int:
        if candidates == 0:
            raise _Fail(node, "no factor of the split dimension is divisible by the tensor degree")
        c = self.choices.get(node, 0)
        if c >= candidates:
            c = candidates - 1
        self.taken.append((node, c, candidates))
        return c


def _resolve(s: Split | None, st: _State) -> Split | None:
    """An undecided split whose origin has been decided since, written with the decision."""
    if s is None or s.split is not None:
        return s
    d = st.decided.get(st.root(s.origin))
    if d is None:
        return s
    return Split(s.dim, d.factors, d.split)


def _feature_split(s: Split, st: _State) -> FeatureSplit:
    """The final partition of a value's split dimension (undecided -> contiguous)."""
    s = _resolve(s, st)
    if s.split is None:
        root = st.root(s.origin)
        st.decided[root] = FeatureSplit(s.factors, 0)
        return st.decided[root]
    return FeatureSplit(s.factors, s.split)


def _map_reshape(node: str, in_shape, out_shape, s: Split, st: _State) -> Split:
    """Follow a split dimension through a reshape (view/reshape/unflatten/flatten/squeeze)."""
    t = st.t
    s = _resolve(s, st)
    atoms: list[list] = []   # [size, tag]; tag: "S" split atom, ("U", k) undecided piece, None
    for i, size in enumerate(in_shape):
        if i == s.dim:
            if s.split is None:
                atoms.append([size, ("U", 0)])
            else:
                for k, f in enumerate(s.factors):
                    atoms.append([f, "S" if k == s.split else None])
        else:
            atoms.append([size, None])
    atoms = [a for a in atoms if a[0] != 1]
    groups: list[list[list]] = []
    ai = 0
    for so in out_shape:
        group: list[list] = []
        prod = 1
        if so == 1:
            groups.append(group)
            continue
        while prod < so:
            if ai >= len(atoms):
                raise _Fail(node, f"cannot follow the split dimension through a reshape of {tuple(in_shape)} "
                                  f"to {tuple(out_shape)}")
            size, tag = atoms[ai]
            if prod * size <= so and so % (prod * size) == 0:
                group.append(atoms[ai])
                prod *= size
                ai += 1
                continue
            need = so // prod
            if so % prod or size % need:
                raise _Fail(node, f"the reshape of {tuple(in_shape)} to {tuple(out_shape)} cuts across the "
                                  "split dimension")
            if tag == "S":
                if need % t:
                    raise _Fail(node, f"the reshape splits the tensor-parallel dimension into {need} x "
                                      f"{size // need}, and {t} does not divide {need}")
                first, second = [need, "S"], [size // need, None]
            elif isinstance(tag, tuple):
                first, second = [need, ("U", 0)], [size // need, ("U", 0)]
            else:
                first, second = [need, None], [size // need, None]
            atoms[ai:ai + 1] = [first, second]
        groups.append(group)
    if ai != len(atoms):
        raise _Fail(node, f"cannot follow the split dimension through a reshape of {tuple(in_shape)} to "
                          f"{tuple(out_shape)}")
    if s.split is not None:
        for o, g in enumerate(groups):
            for k, a in enumerate(g):
                if a[1] == "S":
                    return Split(o, tuple(x[0] for x in g), k)
        raise AssertionError("split atom lost")
    pieces = [(o, k, a) for o, g in enumerate(groups) for k, a in enumerate(g) if isinstance(a[1], tuple)]
    root = st.root(s.origin)
    if len(pieces) == 1:
        o, k, a = pieces[0]
        if len(groups[o]) == 1:
            return Split(o, (a[0],), None, s.origin)
        st.decided[root] = FeatureSplit((a[0],), 0)
        return Split(o, tuple(x[0] for x in groups[o]), k)
    cands = [i for i, (_o, _k, a) in enumerate(pieces) if a[0] % t == 0]
    c = cands[st.choose(node, len(cands))]
    st.decided[root] = FeatureSplit(tuple(a[0] for _o, _k, a in pieces), c)
    o, k, _a = pieces[c]
    return Split(o, tuple(x[0] for x in groups[o]), k)

