"""Tensor-parallel shardings found from the graph (Megatron pattern, no model special cases).

A weight op (Linear or conv) whose output flows, through ops that act
independently per feature/head/channel, into other weight ops forms a
column -> row region: the first ops are split on their output features
(column-parallel), the last on their input features (row-parallel), and
everything between runs on 1/t of the features. Forward needs one
all-reduce after each row-parallel op; backward one all-reduce of the input
gradient of the column group. The same rule finds GPT's qkv -> proj and
fc1 -> fc2, Llama's q/k/v -> o and gate/up -> down, BERT's query/key/value,
and conv -> BatchNorm -> ReLU -> conv in a CNN. A weight op whose region
reaches the model's output (the vocabulary projection) is column-parallel
with a vocabulary-parallel loss. Embeddings split their vocabulary and
all-reduce their output. Everything else is replicated on the t ranks.

Roles do not depend on t; `ShardingPlan.constraints` lists the split sizes
(heads, features, channels, vocabulary): t must divide the heads, and the key/value heads of
grouped-query attention (each rank holds whole key/value heads and the query heads reading
them); a vocabulary or a feature count that t does not divide is padded to a multiple of t
(runtime/parallel/tensor/layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.graph.model import ModelGraph, OpInfo
from runtime.vocab import OpKind, ShardRole

# Ops that act independently on each output feature / head / channel, so a
# tensor split on that dimension can flow through them unchanged.
_TRANSPARENT = (OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.ATTENTION, OpKind.SOFTMAX, OpKind.MATMUL, OpKind.POOL,
                OpKind.CONCAT)
_WEIGHT = (OpKind.LINEAR, OpKind.CONV)


@dataclass(frozen=True)
class NodeShard:
    """Tensor-parallel role of one node.

    role: a ShardRole: REPLICATE, COLUMN, ROW, INNER (between column and row ops),
    "vocab" (vocabulary-split embedding), "column_out" (column op whose region
    ends at the model output). `fwd_allreduce` / `bwd_allreduce` are bytes
    all-reduced over the tensor axis in forward / backward for the example batch.
    """

    role: str
    fwd_allreduce: int = 0
    bwd_allreduce: int = 0
    region: int = -1  # the column->row region (or vocab embedding) this node belongs to; -1 if none
    split_size: int = 0  # the size its region splits (vocabulary, features); 0 if unknown

    @property
    def sharded(self) -> bool:
        return self.role != ShardRole.REPLICATE

    def divisor(self, tensor: int) -> float:
        """What the node's work and weights are divided by on `tensor` ranks: `tensor`, or less where
        a split size `tensor` does not divide is padded (each rank holds ceil(size / tensor))."""
        size = self.split_size
        if tensor > 1 and size and size % tensor:
            return size / -(-size // tensor)
        return float(tensor)


@dataclass(frozen=True)
class ShardingPlan:
    roles: dict  # node name -> NodeShard (a dict for speed; treat as read-only)
    # (what, size, paddable, region): split sizes; the tensor degree must divide those not paddable
    constraints: tuple[tuple[str, int, bool, int], ...]

    def check(self, tensor: int) -> None:
        """ValueError naming the first size that `tensor` must divide and does not."""
        for what, size, paddable, _region in self.constraints:
            if size % tensor and not paddable:
                raise ValueError(f"tensor degree {tensor} does not divide {what} = {size}; "
                                 f"pick a tensor degree that divides {size}")


def find_sharding(graph: ModelGraph) -> ShardingPlan:
    by_name = {n.name: n for n in graph.nodes}
    users: dict[str, list[str]] = {n.name: [] for n in graph.nodes}
    for n in graph.nodes:
        for i in n.inputs:
            if i in users:
                users[i].append(n.name)

    anc = _weight_ancestry(graph)
    next_region = 0
    roles: dict[str, NodeShard] = {}
    constraints: list[tuple[str, int, bool, int]] = []
    for n in graph.nodes:
        if n.name in roles:
            continue
        if n.kind == OpKind.EMBEDDING and _has_weight(n, by_name) and _indexed_by_input(n, by_name):
            vocab = _param_rows(n, by_name)
            roles[n.name] = NodeShard(ShardRole.VOCAB, fwd_allreduce=n.output_bytes, region=next_region,
                                      split_size=vocab)
            next_region += 1
            constraints.append((f"the vocabulary of {n.module_path or n.name}", vocab, True, next_region - 1))
        elif n.kind in _WEIGHT and _has_weight(n, by_name):
            region = _grow_region(n, by_name, users, roles, anc)
            if region is None:
                continue
            cols, inner, rows, to_output = region
            bwd_inputs = {i for c in cols for i in by_name[c].inputs if _is_activation(by_name.get(i))}
            bwd_bytes = sum(by_name[i].output_bytes for i in bwd_inputs)
            region = next_region
            next_region += 1
            has_heads = any(by_name[i].kind == OpKind.ATTENTION for i in inner)
            size = 0 if has_heads else max(_out_features(by_name[c]) for c in cols)
            for k, c in enumerate(sorted(cols, key=_order(graph))):
                roles[c] = NodeShard(ShardRole.COLUMN_OUT if to_output else ShardRole.COLUMN,
                                     bwd_allreduce=bwd_bytes if k == 0 else 0, region=region, split_size=size)
                constraints.append((f"the output features of {by_name[c].module_path or c}", _out_features(by_name[c]),
                                    True, region))
            for i in inner:
                roles[i] = NodeShard(ShardRole.INNER, region=region, split_size=size)
                if by_name[i].kind == OpKind.ATTENTION and by_name[i].input_meta:
                    where = by_name[i].module_path or i
                    heads = by_name[i].input_meta[0].shape[1]
                    constraints.append((f"the heads of {where}", heads, False, region))
                    kv = _kv_heads(by_name[i], by_name, anc)
                    if kv != heads:   # grouped-query attention: each rank holds whole key/value heads
                        constraints.append((f"the key/value heads of {where}", kv, False, region))
            for r in rows:
                roles[r] = NodeShard(ShardRole.ROW, fwd_allreduce=by_name[r].output_bytes, region=region,
                                     split_size=size)
    for n in graph.nodes:
        roles.setdefault(n.name, NodeShard(ShardRole.REPLICATE))
    return ShardingPlan(roles=roles, constraints=tuple(dict.fromkeys(constraints)))


def _kv_heads(attn: OpInfo, by_name: dict, anc: dict[str, bool]) -> int:
    """The key/value heads of an attention node (B, H, T, D) inputs: the fewest heads of a
    (B, h, T, D) tensor on the way back from its key input to the key projection. Grouped-query
    attention reads H / Hkv as few (SDPA's enable_gqa), or repeats them to H first (Hugging Face's
    repeat_kv: unsqueeze, expand, reshape), so the walk passes the repeat and finds Hkv. The walk
    follows the values computed from weights (`anc`), never a rotary table or a mask beside them."""
    batch, rest = attn.input_meta[0].shape[0], tuple(attn.input_meta[1].shape[2:])
    heads = attn.input_meta[1].shape[1]
    cur = by_name.get(attn.inputs[1])
    for _ in range(64):   # a repeat and a rotary embedding are a dozen ops; far below this bound
        if cur is None or cur.kind not in (OpKind.VIEW, OpKind.ELEMENTWISE, OpKind.CONCAT) or not cur.output_meta:
            break
        shape = tuple(cur.output_meta[0].shape)
        if len(shape) == 4 and shape[0] == batch and shape[2:] == rest:
            heads = min(heads, shape[1])
        src = [by_name[i] for i in cur.inputs if anc.get(i, False) and _is_activation(by_name.get(i))]
        cur = src[0] if src else None
    return heads


def _order(graph: ModelGraph):
    pos = {n.name: i for i, n in enumerate(graph.nodes)}
    return pos.__getitem__


def _has_weight(n: OpInfo, by_name: dict | None = None) -> bool:
    """A weight op: it owns parameters, is a module, or reads a parameter directly (a tied
    weight's second user owns none: GPT-2's output layer reads the token embedding's)."""
    if n.param_count > 0 or n.op == "call_module" or any(True for _ in n.param_names):
        return True
    return by_name is not None and any(by_name[i].kind == OpKind.PARAM for i in n.inputs if i in by_name)


def _is_activation(n: OpInfo | None) -> bool:
    return n is not None and n.kind not in (OpKind.PARAM, OpKind.SCALAR) and bool(n.output_meta)


def _weight_ancestry(graph: ModelGraph) -> dict[str, bool]:
    """Whether each node's value depends on a weight op (the model's data stream).

    Tensors that do not (attention masks, rotary tables, position ids) are
    constants as far as tensor parallelism goes: any split tensor may meet them.
    """
    anc: dict[str, bool] = {}
    by_name = {n.name: n for n in graph.nodes}
    for n in graph.nodes:
        anc[n.name] = (n.kind in _WEIGHT and _has_weight(n, by_name)) or n.kind == OpKind.EMBEDDING or \
            any(anc.get(i, False) for i in n.inputs)
    return anc


def _grow_region(start: OpInfo, by_name, users, roles, anc):
    """Column ops, inner ops and row ops of the region that starts at `start`, or None."""
    cols, inner, rows = {start.name}, set(), set()
    pulled: set[str] = set()  # inner ops found by walking back from the region (sibling paths)
    to_output = False
    queue = [start.name]

    def is_weight(n: OpInfo) -> bool:
        return n.kind in _WEIGHT and _has_weight(n, by_name)

    def transparent(n: OpInfo) -> bool:
        return n.kind in _TRANSPARENT or (n.kind == OpKind.NORM and "atch" in n.target)

    # Grow forward from every member until the region is closed, then pull in
    # sibling paths that feed its ops (k and v beside q); repeat until stable.
    while queue:
        while queue:
            name = queue.pop()
            for u in users[name]:
                un = by_name[u]
                if u in cols or u in inner or u in rows:
                    continue
                if is_weight(un):
                    if u in roles:
                        return None
                    rows.add(u)
                elif transparent(un):
                    # BatchNorm normalizes per channel: transparent to a channel split.
                    inner.add(u)
                    queue.append(u)
                elif un.kind == OpKind.OUTPUT:
                    to_output = True
                elif un.kind == OpKind.SCALAR:
                    continue
                else:  # layer norm, loss: needs the whole feature dimension
                    return None
        for name in list(inner):
            node = by_name[name]
            if _is_sum(node) and name not in pulled:
                continue  # a sum reached from the region: checked once the region is complete
            for i in node.inputs:
                src = by_name.get(i)
                if not _is_activation(src) or i in cols or i in inner or not anc.get(i, False):
                    continue  # parameters, shapes, and constants (masks, rotary tables)
                if is_weight(src):
                    if i in roles or i in rows:
                        return None
                    cols.add(i)  # a sibling projection: k and v beside q, up beside gate
                elif transparent(src):
                    inner.add(i)  # the sibling's path (k's reshape, rotary, head repeat)
                    pulled.add(i)
                else:
                    return None  # a norm or similar: a full-feature tensor meets the split one
                queue.append(i)
    for name in inner - pulled:
        if _is_sum(by_name[name]):
            for i in by_name[name].inputs:
                src = by_name.get(i)
                if _is_activation(src) and anc.get(i, False) and i not in inner and i not in cols:
                    return None  # a residual: the full stream meets the split tensor
    if to_output and rows:
        return None
    if not rows and not to_output:
        return None
    return cols, inner, rows, to_output


def _is_sum(n: OpInfo) -> bool:
    """add/sub: a residual connection, where a split tensor may not meet a full one."""
    base = n.target.rsplit(".", 1)[-1]
    return base in ("add", "sub", "iadd", "add_", "sub_")


def _indexed_by_input(n: OpInfo, by_name) -> bool:
    """An embedding looked up by the model's input ids (tokens), not by positions or types.

    Only the token table is split by vocabulary (Megatron's vocab-parallel
    embedding); position and token-type tables are small and replicated.
    """
    seen = 0
    cur = by_name.get(n.inputs[-1]) if n.op == "call_module" else None
    if cur is None:  # functional embedding(weight, ids): ids is the activation input
        acts = [by_name[i] for i in n.inputs if by_name.get(i) is not None and by_name[i].kind != OpKind.PARAM]
        cur = acts[0] if acts else None
    while cur is not None and seen < 16:
        if cur.kind == OpKind.INPUT:
            return True
        if cur.kind != OpKind.VIEW or not cur.inputs:
            return False
        cur = by_name.get(cur.inputs[0])
        seen += 1
    return False


def _out_features(n: OpInfo) -> int:
    shape = n.output_meta[0].shape
    return shape[1] if n.kind == OpKind.CONV else shape[-1]


def _param_rows(n: OpInfo, by_name: dict) -> int:
    """Rows of an embedding table: bytes / (row bytes) from the output's last dim, or the
    shape of the table it reads directly (a tied table's second user owns no parameters)."""
    if not n.param_count:
        table = next((by_name[i] for i in n.inputs if i in by_name and by_name[i].kind == OpKind.PARAM), None)
        return table.output_meta[0].shape[0] if table is not None and table.output_meta else 0
    dim = n.output_meta[0].shape[-1]
    elem = n.param_bytes // max(n.param_count, 1)
    return n.param_bytes // max(dim * elem, 1)


def without_regions(plan: ShardingPlan, regions: set[int]) -> ShardingPlan:
    """`plan` with the nodes of `regions` replicated (and their size constraints gone)."""
    if not regions:
        return plan
    roles = {n: (NodeShard(ShardRole.REPLICATE) if r.region in regions else r) for n, r in plan.roles.items()}
    return ShardingPlan(roles=roles, constraints=tuple(c for c in plan.constraints if c[3] not in regions))
