"""The tensor split's rule of each op: how the split of an op's inputs gives the split of its output
(planner/strategies/tensor/split/rules.py walks the graph and asks `_rule` at every node that reads a
split value).

Module calls (norms and pooling over channels, parameter-free elementwise modules, Flatten) have
`_module_rule`; functions and methods a rule each in `_RULES`, keyed by the op's name (views,
permutes, indexing, parts, softmax, attention, matmul, concatenation), and elementwise ops
`_elementwise`. Where split values meet (`_unify`) they must be split alike, or be made so where one
is still undecided; grouped-query attention pairs each rank's query heads with its key/value heads.
A rule that cannot let its op run split raises _Fail naming the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.strategies.tensor.split.state import Split, _Fail, _feature_split, _map_reshape, _resolve, _State, norm_dim
from runtime.program.shards import FeatureSplit
from runtime.vocab import ShardRole

# op and module names by what the split does through them
_ELEMENTWISE_FUNCS = {
    "add", "sub", "mul", "truediv", "div", "floordiv", "neg", "pow", "relu", "relu_", "gelu", "silu", "sigmoid",
    "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "erf", "softplus", "mish", "hardswish", "hardsigmoid",
    "leaky_relu", "elu", "selu", "celu", "dropout", "dropout1d", "dropout2d", "dropout3d", "masked_fill",
    "where", "clamp", "clip", "square", "sin", "cos", "reciprocal", "iadd", "imul", "isub", "mod", "to", "float",
    "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone", "detach", "relu6", "logical_not",
    "mul_", "add_", "tanh_", "sigmoid_", "gelu_", "silu_", "sign", "maximum", "minimum",
    "lerp", "addcmul", "addcdiv", "nan_to_num", "view_as", "expand_as",
}
_ELEMENTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity,
    nn.AlphaDropout,
)
_POOL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                 nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                 nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_POOL_FUNCS = {"max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
               "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d"}
_RESHAPES = {"view", "reshape", "unflatten", "flatten", "squeeze", "unsqueeze", "_unsafe_view"}


def _index_map(node: str, ndim: int, index, s: Split) -> Split:
    """Follow the split dimension through tensor[index] (ints, slices, None, Ellipsis)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, (torch.Tensor, fx.Node, list)) for i in items):
        raise _Fail(node, "advanced (tensor or list) indexing of a tensor-parallel value is not supported")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    out_dim, in_dim = 0, 0
    for i in items:
        if i is Ellipsis:
            skip = ndim - consumed
            if in_dim <= s.dim < in_dim + skip:
                return Split(out_dim + s.dim - in_dim, s.factors, s.split, s.origin)
            in_dim += skip
            out_dim += skip
        elif i is None:
            out_dim += 1
        elif isinstance(i, int):
            if in_dim == s.dim:
                raise _Fail(node, "indexing selects along the tensor-parallel dimension")
            in_dim += 1
        elif isinstance(i, slice):
            if in_dim == s.dim and (i.start not in (None, 0) or i.stop is not None or i.step not in (None, 1)):
                raise _Fail(node, "slicing along the tensor-parallel dimension")
            if in_dim == s.dim:
                return Split(out_dim, s.factors, s.split, s.origin)
            in_dim += 1
            out_dim += 1
        else:
            raise _Fail(node, f"unsupported index {i!r} on a tensor-parallel value")
    return Split(out_dim + s.dim - in_dim, s.factors, s.split, s.origin)


def _rule(n, mod, base, full, sharded, tensor_args, vals, st, uses, split_of):
    """The split of node `n`'s output (a Split, a tuple of them, or None where it is no tensor), from the
    splits of its inputs (`split_of`); _Fail naming the node where no rule lets it run split."""
    out = full.get(n.name)
    if not isinstance(out, (torch.Tensor, tuple, list)):   # size(), dim(), .shape, .device
        return None
    if n.op == "call_module":
        return _module_rule(n, mod, out, full, sharded[0][1], st, uses)
    if base == "getitem" and isinstance(vals.get(n.args[0].name), tuple):   # split/chunk/unbind outputs
        return vals[n.args[0].name][n.args[1]]
    rule = _RULES.get(base)
    if rule is not None:
        src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        in_shape = tuple(full[src.name].shape) if src is not None and isinstance(full.get(src.name), torch.Tensor) \
            else None
        return rule(_Op(n, n.name, base, out, full, st, split_of, split_of(src) if src is not None else None,
                        in_shape))
    if base in _ELEMENTWISE_FUNCS:
        return _elementwise(n.name, n, out, sharded, tensor_args, full, st)
    raise _Fail(n.name, f"{base} cannot run on a tensor split over the tensor axis (no rule for it)")


def _module_rule(n, mod: nn.Module, out, full, s: Split, st: _State, uses: list) -> Split:
    """A module call on a split tensor `s`: norms and pooling over channels, parameter-free elementwise
    modules, Flatten."""
    name = n.name
    if isinstance(mod, nn.modules.batchnorm._NormBase):
        if s.dim != 1:
            raise _Fail(name, "a BatchNorm reads a tensor split on a dimension other than its channels")
        uses.append((name, str(n.target), ShardRole.CHANNELS, s))
        return s
    if isinstance(mod, _POOL_MODULES):
        if s.dim != 1:
            raise _Fail(name, "pooling a tensor split on a dimension other than its channels")
        return s
    if isinstance(mod, _ELEMENTWISE_MODULES) and not any(True for _ in mod.parameters()):
        return s
    if isinstance(mod, nn.Flatten):
        return _map_reshape(name, full[n.args[0].name].shape, out.shape, s, st)
    raise _Fail(name, f"module {type(mod).__name__} cannot run on a tensor split over the tensor axis")


@dataclass(frozen=True)
class _Op:
    """One function or method node as a rule sees it: its output `out` (full size), the split `s` and full
    shape `in_shape` of its first argument (None where that is no tensor), and the analysis state."""

    n: fx.Node
    name: str
    base: str
    out: Any
    full: dict
    st: "_State"
    split_of: Any        # fx node -> its Split, or None where replicated
    s: Split | None
    in_shape: tuple[int, ...] | None

    def moved(self, dim: int) -> Split:
        """The input's split, on dimension `dim` of the output."""
        s = self.s
        return Split(dim, s.factors, s.split, s.origin)


def _reshape(o: _Op):
    if o.s is None:
        raise _Fail(o.name, f"{o.base} of a replicated tensor mixed with a split one")
    return _map_reshape(o.name, o.in_shape, tuple(o.out.shape), o.s, o.st)


def _permute(o: _Op):
    n = o.n
    dims = n.args[1:] if len(n.args) > 2 or not isinstance(n.args[1], (tuple, list)) else n.args[1]
    dims = [norm_dim(d, len(o.in_shape)) for d in dims]
    return o.moved(dims.index(o.s.dim))


def _transpose(o: _Op):
    a, b = (norm_dim(d, len(o.in_shape)) for d in o.n.args[1:3])
    d = o.s.dim
    return o.moved(b if d == a else a if d == b else d)


def _t(o: _Op):
    return o.moved(1 - o.s.dim) if len(o.in_shape) == 2 else o.s


def _getitem(o: _Op):
    return _index_map(o.name, len(o.in_shape), o.n.args[1], o.s)


def _slice(o: _Op):   # aten.slice(x, dim, start, end, step), narrow(x, dim, start, length)
    d = norm_dim(o.n.args[1] if len(o.n.args) > 1 else 0, len(o.in_shape))
    if d == o.s.dim and tuple(o.out.shape) != o.in_shape:
        raise _Fail(o.name, f"{o.base} along the tensor-parallel dimension")
    return o.s


def _select(o: _Op):   # aten.select(x, dim, index): drops dim
    d = norm_dim(o.n.args[1], len(o.in_shape))
    if d == o.s.dim:
        raise _Fail(o.name, "select along the tensor-parallel dimension")
    return o.moved(o.s.dim - (1 if d < o.s.dim else 0))


def _same(o: _Op):
    return o.s


def _parts(o: _Op):
    """split, chunk, unbind, split_with_sizes: one Split per part."""
    n, s, name, base, in_shape = o.n, o.s, o.name, o.base, o.in_shape
    dim = norm_dim(n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0), len(in_shape))
    parts = list(o.out)
    if base == "unbind":
        if dim == s.dim:
            raise _Fail(name, "unbind along the tensor-parallel dimension")
        return tuple(o.moved(s.dim - (1 if dim < s.dim else 0)) for _ in parts)
    if dim != s.dim:
        return tuple(o.moved(s.dim) for _ in parts)
    sizes = {p.shape[dim] for p in parts}
    if len(sizes) != 1:
        raise _Fail(name, f"{base} cuts the tensor-parallel dimension into unequal parts {[p.shape[dim] for p in parts]}")
    k, rest = len(parts), parts[0].shape[dim]
    mid = tuple(in_shape[:dim]) + (k, rest) + tuple(in_shape[dim + 1:])
    inner = _map_reshape(name, in_shape, mid, s, o.st)
    if inner.dim != dim + 1:
        if inner.split is None:
            raise AssertionError
        raise _Fail(name, f"{base} separates parts along the split factor")
    return tuple(Split(dim, inner.factors, inner.split, inner.origin) for _ in parts)


def _expand(o: _Op):
    return o.moved(o.s.dim + o.out.dim() - len(o.in_shape))


def _pool(o: _Op):
    if o.s.dim != 1:
        raise _Fail(o.name, "pooling a tensor split on a dimension other than its channels")
    return o.s


def _softmax(o: _Op):
    n = o.n
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    if dim is None or norm_dim(dim, len(o.in_shape)) == o.s.dim:
        raise _Fail(o.name, f"{o.base} over the tensor-parallel dimension")
    return o.s


def _attention(o: _Op):
    """scaled_dot_product_attention: q, k and v split by heads (grouped query heads included)."""
    n, name, full, st = o.n, o.name, o.full, o.st
    qkv = [o.split_of(a) for a in n.args[:3]]
    if any(x is None for x in qkv):
        raise _Fail(name, "attention whose q, k and v are not all split by heads")
    nd = len(o.in_shape)
    for x in qkv:
        if x.dim != nd - 3:
            raise _Fail(name, "attention inputs must be split on the heads dimension (B, H, T, D)")
    q_heads, kv_heads = full[n.args[0].name].shape[nd - 3], full[n.args[1].name].shape[nd - 3]
    if q_heads == kv_heads:
        _unify(name, qkv, st)
    else:
        _grouped_heads(name, qkv, q_heads, kv_heads, st)
    for a in list(n.args[3:]) + list(n.kwargs.values()):
        if isinstance(a, fx.Node) and o.split_of(a) is None and isinstance(full.get(a.name), torch.Tensor):
            m = full[a.name]
            aligned = nd - 3 - (nd - m.dim())
            if aligned >= 0 and m.shape[aligned] != 1:   # a mask or bias per head: this rank's heads of it
                st.scatters.append((name, a.name, aligned, qkv[0]))
    return _resolve(qkv[0], st)


def _matmul(o: _Op):
    """matmul, bmm, baddbmm: only split batch (heads) dimensions pass through."""
    n, name, full, st = o.n, o.name, o.full, o.st
    a, b = n.args[0], n.args[1]
    sa, sb = o.split_of(a), o.split_of(b)
    na, nb, no = full[a.name].dim(), full[b.name].dim(), o.out.dim()
    outs = []
    for x, nx in ((sa, na), (sb, nb)):
        if x is None:
            continue
        if x.dim >= nx - 2:
            raise _Fail(name, "a matmul contracts or keeps a split feature dimension; only split batch "
                              "(heads) dimensions can pass through")
        outs.append(Split(x.dim + no - nx, x.factors, x.split, x.origin))
    if len(outs) == 2 and outs[0].dim != outs[1].dim:
        raise _Fail(name, "matmul operands split on different dimensions")
    if len(outs) == 2:
        _unify(name, [sa, sb], st)
    else:
        other = b if sa is not None else a
        x = outs[0]
        m = full[other.name]
        aligned = x.dim - (no - m.dim())
        if 0 <= aligned < m.dim() - 2 and m.shape[aligned] != 1:
            raise _Fail(name, "a split operand meets a full-size operand in a matmul")
    return _resolve(outs[0], st)


def _cat(o: _Op):
    n = o.n
    dim = norm_dim(n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0), o.out.dim())
    ss = [o.split_of(a) for a in n.args[0]]
    if any(x is None for x in ss) or any(x.dim == dim for x in ss):
        raise _Fail(o.name, "concatenation along, or with replicated tensors across, the split dimension")
    _unify(o.name, ss, o.st)
    return _resolve(ss[0], o.st)


# op (aten or torch name without overload) -> its rule; where a name is in two groups, the first listed wins
_RULE_GROUPS = ((_RESHAPES, _reshape), (("permute",), _permute), (("transpose", "swapaxes", "swapdims"), _transpose),
                (("t",), _t), (("getitem",), _getitem), (("slice", "narrow"), _slice), (("select",), _select),
                (("alias", "lift_fresh_copy", "_to_copy"), _same),
                (("split", "chunk", "unbind", "split_with_sizes"), _parts), (("expand",), _expand),
                (_POOL_FUNCS, _pool), (("softmax", "log_softmax", "_softmax"), _softmax),
                (("scaled_dot_product_attention",), _attention), (("matmul", "bmm", "baddbmm"), _matmul),
                (("cat", "concat", "concatenate"), _cat))
_RULES = {name: rule for names, rule in reversed(_RULE_GROUPS) for name in names}


def _unify(name: str, splits: list[Split], st: _State) -> None:
    splits = [_resolve(s, st) for s in splits]
    undecided = [s for s in splits if s.split is None]
    decided = [s for s in splits if s.split is not None]
    for s in undecided[1:]:
        if s.factors != undecided[0].factors:
            raise _Fail(name, "tensors split with different sizes meet")
        st.union(undecided[0].origin, s.origin)
    if decided:
        d0 = decided[0]
        for s in decided[1:]:
            if (s.factors, s.split) != (d0.factors, d0.split) and not _same_partition(s, d0, st.t):
                raise _Fail(name, f"tensors split differently meet ({s.factors}/{s.split} vs {d0.factors}/{d0.split})")
        for s in undecided:
            if s.size != d0.size:
                raise _Fail(name, "tensors split with different sizes meet")
            st.decided[st.root(s.origin)] = FeatureSplit(d0.factors, d0.split)


def _grouped_heads(name: str, qkv: list[Split], q_heads: int, kv_heads: int, st: _State) -> None:
    """Grouped-query attention (SDPA with enable_gqa): k and v split alike over their `kv_heads`
    heads, q over its `q_heads`, and every rank holding exactly the query heads that read its
    key/value heads (query head h reads key/value head h // (q_heads / kv_heads)), so that each
    rank's attention is the same grouped-query attention on fewer heads. Contiguous blocks of both
    satisfy it: rank r holds kv heads [r*Hkv/t, (r+1)*Hkv/t) and q heads [r*H/t, (r+1)*H/t)."""
    t = st.t
    q, k, v = qkv
    _unify(name, [k, v], st)
    if kv_heads % t:
        raise _Fail(name, f"grouped-query attention has {kv_heads} key/value heads, and the tensor degree {t} "
                          f"does not divide them; choose a tensor degree that divides {kv_heads}")
    q_fs, kv_fs = _feature_split(q, st), _feature_split(k, st)
    if q_fs.size != q_heads or kv_fs.size != kv_heads or q_fs.padded(t) or kv_fs.padded(t):
        raise _Fail(name, "grouped-query attention inputs must be split by whole heads")
    group = q_heads // kv_heads
    for r in range(t):
        kv_idx = kv_fs.indices(r, t)
        want = (kv_idx[:, None] * group + torch.arange(group)).flatten()
        if not torch.equal(q_fs.indices(r, t), want):
            raise _Fail(name, f"grouped-query attention: rank {r}'s query heads are not those that read its "
                              f"key/value heads (q split {q_fs.to_list()}, k/v split {kv_fs.to_list()})")


def _same_partition(a: Split, b: Split, t: int) -> bool:
    """Whether two splits give every rank the same indices: (4,)/0 and (2, 2)/0 both give each
    of 2 ranks two consecutive heads (Llama's query heads beside its repeated key heads)."""
    if a.size != b.size or a.factors[a.split] % t or b.factors[b.split] % t:
        return False
    fa, fb = FeatureSplit(a.factors, a.split), FeatureSplit(b.factors, b.split)
    return all(torch.equal(fa.indices(r, t), fb.indices(r, t)) for r in range(t))


def _elementwise(name, n, out, sharded, tensor_args, full, st) -> Split:
    nd = out.dim()
    aligned = []
    for a, s in sharded:
        m = full[a.name]
        aligned.append(Split(s.dim + nd - m.dim(), s.factors, s.split, s.origin))
    if len({x.dim for x in aligned}) != 1:
        raise _Fail(name, "elementwise op on tensors split on different dimensions")
    _unify(name, aligned, st)
    d = aligned[0].dim
    split_names = {a.name for a, _ in sharded}
    for a in tensor_args:
        if a.name in split_names or not isinstance(full.get(a.name), torch.Tensor):
            continue
        m = full[a.name]
        k = d - (nd - m.dim())
        if 0 <= k < m.dim() and m.shape[k] != 1:
            if m.shape[k] != aligned[0].size:
                raise _Fail(name, f"a tensor ({a.name}, {tuple(m.shape)}) meets a tensor split on dimension {d} "
                                  f"with another size there ({m.shape[k]}, not {aligned[0].size})")
            st.scatters.append((name, a.name, k, aligned[0]))   # replicated: every rank takes its part
    return _resolve(aligned[0], st)

