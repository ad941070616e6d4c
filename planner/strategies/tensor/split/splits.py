"""`TensorSplits`: the tensor-parallel split of a plan, decided by the planner and stored in the Plan.

The planner's split analysis (analysis.py) works out, for a graph, the roles of its nodes and a
tensor degree, which dimension of every value is divided over the tensor ranks and how; the
code generator only applies it (codegen/strategies/tensor/split.py: shape constants rewritten to local
sizes, weights partitioned, communication inserted). A value of this type round-trips through
the Plan's JSON ("tensor_splits"); its sequence part (`SequenceSplit`) is found by sequence.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from runtime.documents import Fields
from runtime.program.shards import FeatureSplit, ModuleShard, ParamShard, ShardError
from runtime.vocab import SPLIT_ROLES, ShardRole


@dataclass(frozen=True)
class SequenceSplit:
    """Where the sequence split lives in one graph (fx node names; planner/strategies/tensor/split/sequence.py).

    length: the sequence length T (dimension 1 of every split value); the tensor degree divides it.
    starts: row-parallel ops and vocabulary-parallel embeddings whose output is reduce-scattered.
    nodes: replicated ops that run on this rank's T/t tokens.
    columns: column-parallel ops whose input is split (all-gathered in forward).
    gathers: (consumer, value): a split value that `consumer` reads whole.
    scatters: (consumer, replicated input, its dimension): a replicated tensor cut to this rank's tokens.
    params: parameters (get_attr targets, or module paths for modules) read on split tokens; their
        gradient is all-reduced over the tensor axis.
    """

    length: int
    starts: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()
    gathers: tuple[tuple[str, str], ...] = ()
    scatters: tuple[tuple[str, str, int], ...] = ()
    params: tuple[str, ...] = ()

    # (cached: the cost model asks for every node of every configuration it prices)
    @cached_property
    def split(self) -> frozenset[str]:
        """Every node whose output is split along the sequence."""
        return frozenset(self.starts) | frozenset(self.nodes)

    @cached_property
    def gathering(self) -> frozenset[str]:
        """The column ops that gather their input along the sequence."""
        return frozenset(self.columns)

    @cached_property
    def read_whole(self) -> dict[str, tuple[str, ...]]:
        """consumer -> the split values it reads whole."""
        out: dict[str, tuple[str, ...]] = {}
        for consumer, value in self.gathers:
            out[consumer] = out.get(consumer, ()) + (value,)
        return out

    def to_dict(self) -> dict:
        return {"length": self.length, "starts": list(self.starts), "nodes": list(self.nodes),
                "columns": list(self.columns), "gathers": [list(g) for g in self.gathers],
                "scatters": [list(s) for s in self.scatters], "params": list(self.params)}

    @classmethod
    def read(cls, f: Fields) -> "SequenceSplit":
        """From a checked document reader; FieldError names the field on any damage."""
        names = {key: tuple(f.strings(key)) for key in ("starts", "nodes", "columns", "params")}
        gathers = []
        for k, g in enumerate(f.items("gathers")):
            if not isinstance(g, list) or len(g) != 2 or not all(isinstance(x, str) for x in g):
                raise f.error(f"gathers[{k}]", "must be [consumer, value]")
            gathers.append((g[0], g[1]))
        scatters = []
        for k, s in enumerate(f.items("scatters")):
            if not isinstance(s, list) or len(s) != 3 or not all(isinstance(x, str) for x in s[:2]) \
                    or isinstance(s[2], bool) or not isinstance(s[2], int) or s[2] < 0:
                raise f.error(f"scatters[{k}]", "must be [consumer, input, dimension]")
            scatters.append((s[0], s[1], s[2]))
        return cls(length=f.integer("length", minimum=1), gathers=tuple(gathers), scatters=tuple(scatters), **names)


@dataclass(frozen=True)
class TensorSplits:
    """How one graph is split over `tensor` ranks.

    values: (fx node, dimension, split) for every value split over the tensor axis: the
        dimension of the node's output that is divided, and how its entries are partitioned.
    modules: how each split module (nn.Linear, nn.ConvNd, nn.Embedding, BatchNorm) is split.
    params: how each weight read directly by an ATen op (get_attr) is split.
    weight_ops: (fx node, role) of every ATen op that reads a split weight, in graph order.
    scatters: (reading node, replicated input, its dimension, split): a replicated tensor that
        meets a split one (a per-head bias or mask) is cut to each rank's part where it is read.
    output: the split of the model output's last dimension (vocabulary-parallel logits), or None.
    sequence: where the values between regions are split along the sequence (sequence
        parallelism, planner/strategies/tensor/split/sequence.py), or None.
    """

    tensor: int
    values: tuple[tuple[str, int, FeatureSplit], ...] = ()
    modules: tuple[ModuleShard, ...] = ()
    params: tuple[ParamShard, ...] = ()
    weight_ops: tuple[tuple[str, ShardRole], ...] = ()
    scatters: tuple[tuple[str, str, int, FeatureSplit], ...] = ()
    output: FeatureSplit | None = None
    sequence: SequenceSplit | None = None

    def part_splits(self) -> tuple[str, ...]:
        """Paths of the split modules whose split is not one contiguous block per rank (FeatureSplit.groups
        > 1: a fused projection split by parts)."""
        return tuple(m.path for m in self.modules if m.split.groups > 1)

    def to_dict(self) -> dict:
        d = {
            "tensor": self.tensor,
            "values": {node: [dim, *fs.to_list()] for node, dim, fs in self.values},
            "modules": {sh.path: [str(sh.role), *sh.split.to_list()]
                        + ([] if sh.sequence_dim is None else [sh.sequence_dim]) for sh in self.modules},
            "params": {ps.name: [ps.dim, *ps.split.to_list()] for ps in self.params},
            "weight_ops": {node: str(role) for node, role in self.weight_ops},
            "scatters": [[node, x, dim, *fs.to_list()] for node, x, dim, fs in self.scatters],
            "output": None if self.output is None else self.output.to_list(),
        }
        if self.sequence is not None:   # absent without sequence parallelism (plans written before it read alike)
            d["sequence"] = self.sequence.to_dict()
        return d

    @classmethod
    def read(cls, f: Fields) -> "TensorSplits":
        """From a checked document reader; FieldError names the field on any damage."""
        values = tuple((node, dim, fs) for node, (dim, fs) in _dim_splits(f, "values").items())
        modules = []
        for path, entry in f.sub("modules").data.items():
            if not isinstance(entry, list) or len(entry) not in (3, 4) or entry[0] not in SPLIT_ROLES \
                    or (len(entry) == 4 and not _is_index(entry[3])):
                raise f.error(f"modules.{path}", f"must be [role, factors, split] or [role, factors, split, "
                              f"sequence dimension] with a role of {', '.join(ShardRole)}")
            modules.append(ModuleShard(path, ShardRole(entry[0]), _split(f, f"modules.{path}", entry[1:3]),
                                       entry[3] if len(entry) == 4 else None))
        params = tuple(ParamShard(name, dim, fs) for name, (dim, fs) in _dim_splits(f, "params").items())
        weight_ops = []
        for node, role in f.sub("weight_ops").data.items():
            if role not in SPLIT_ROLES:
                raise f.error(f"weight_ops.{node}", f"is {role!r}; known roles: {', '.join(ShardRole)}")
            weight_ops.append((node, ShardRole(role)))
        scatters = []
        for k, entry in enumerate(f.items("scatters")):
            if not isinstance(entry, list) or len(entry) != 5 or not all(isinstance(x, str) for x in entry[:2]) \
                    or not _is_index(entry[2]):
                raise f.error(f"scatters[{k}]", "must be [node, input, dimension, factors, split]")
            scatters.append((entry[0], entry[1], entry[2], _split(f, f"scatters[{k}]", entry[3:])))
        output = f.raw("output")
        sequence = SequenceSplit.read(f.sub("sequence")) if "sequence" in f.data else None
        return cls(tensor=f.integer("tensor", minimum=2), values=values, modules=tuple(modules), params=params,
                   weight_ops=tuple(weight_ops), scatters=tuple(scatters),
                   output=None if output is None else _split(f, "output", output), sequence=sequence)


def _is_index(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _split(f: Fields, key: str, pair) -> FeatureSplit:
    """A FeatureSplit from [factors, split]; FieldError naming `key` if it is not one."""
    if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], list) \
            or not all(_is_index(x) for x in pair[0]) or not _is_index(pair[1]):
        raise f.error(key, "must give a split as [factors (whole numbers), index of the split factor]")
    try:
        return FeatureSplit.from_list(pair)
    except ShardError as e:
        raise f.error(key, f"is not a split: {e}") from None


def _dim_splits(f: Fields, key: str) -> dict[str, tuple[int, FeatureSplit]]:
    """name -> (dimension, split) from a mapping of name -> [dimension, factors, split]."""
    out = {}
    for name, entry in f.sub(key).data.items():
        if not isinstance(entry, list) or len(entry) != 3 or not _is_index(entry[0]):
            raise f.error(f"{key}.{name}", "must be [dimension, factors, split]")
        out[name] = (entry[0], _split(f, f"{key}.{name}", entry[1:]))
    return out
