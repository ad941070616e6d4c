"""Running a model's repeated nodes once during capture.

The capture's analysis runs every fx node on meta tensors under the FLOP counter and the
saved-tensor hooks (planner/graph/analysis.py). A model's repeated blocks repeat the same
nodes with the same inputs: the 128 blocks of a 1T GPT run the same 19 ops 128 times, and
the dispatch of those runs is most of the capture's time. `ForwardMemo` keeps, per node
signature, what the first run produced, and replays it for the next node of that signature:
fresh meta outputs of the same shapes, strides, dtypes and autograd flag, the same forward
FLOPs and saved bytes, and the same bookkeeping of which input and output storages autograd
now holds. The ModelGraph comes out identical (tests/unit/test_capture_replay.py compares
whole graphs captured with and without it).

A node is replayed only when nothing its result depends on escapes the signature:
- the signature holds the op (function object, method name, or the leaf module's class,
  printed configuration, public attributes and parameter/buffer shapes), every tensor input's
  shape, strides, dtype, autograd flag, whether it is a view, and whether autograd already
  holds its storage, and every other argument's repr;
- all tensors in and out are on the meta device (values computed on a real device, such as an
  `arange` a model builds without a device, can steer later ops);
- no output shares storage with an input or another output (views and in-place ops are run
  every time: replaying them would break the aliasing the saved-byte count depends on).
The first run decides; a signature whose first run breaks a rule is never replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout,
            type(Ellipsis), slice)


@dataclass(frozen=True)
class _Output:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class _Record:
    """What a node's first run produced (see the module docstring)."""

    treedef: Any                      # the output's pytree structure
    outputs: tuple[_Output, ...]      # its tensors, in pytree order
    flops: int                        # forward FLOPs
    saved: int                        # bytes autograd newly saved
    saved_inputs: tuple[int, ...]     # tensor inputs (pytree order) whose storage autograd newly holds
    saved_outputs: tuple[int, ...]    # outputs autograd holds


_NEVER = object()   # a signature whose first run cannot be replayed


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _scalar_repr(x: Any) -> str | None:
    """repr of a plain argument, or None for an object whose repr may not say all it means."""
    if isinstance(x, _SCALARS):
        return repr(x)
    if isinstance(x, (tuple, list, torch.Size)):
        parts = [_scalar_repr(i) for i in x]
        return None if any(p is None for p in parts) else f"{type(x).__name__}({','.join(parts)})"
    return None


def inputs(args: tuple, kwargs: dict, state: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a node reads, in the order its signature lists them."""
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)] + list(state)


class ForwardMemo:
    """Per-capture memo of node runs (one per analysis pass; never shared between captures)."""

    def __init__(self) -> None:
        self._records: dict[tuple, Any] = {}

    def key(self, node, module, args: tuple, kwargs: dict, state: list[torch.Tensor], saved_ids: set[int],
            param_ids: set[int]) -> tuple | None:
        """The node's signature, or None when the node is never replayed.

        `state`: the meta stand-ins of a leaf module's parameters and buffers (autograd may save
        a buffer, e.g. batch norm's running statistics, so they count as inputs)."""
        if node.op == "call_module":
            if module is None:
                return None
            public = tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                                  if not k.startswith("_") and _scalar_repr(v) is not None))
            shapes = tuple((k, tuple(p.shape), p.dtype, p.requires_grad)
                           for k, p in (*module.named_parameters(), *module.named_buffers()))
            op: tuple = ("module", type(module), repr(module), public, shapes, module.training)
        elif node.op == "call_method":
            op = ("method", node.target)
        elif node.op == "call_function" and not isinstance(node.target, torch._ops.HigherOrderOperator):
            op = ("function", node.target)
        else:
            return None
        leaves, spec = tree_flatten((args, kwargs))
        parts = []
        leaves = [*leaves, *state]
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if not x.is_meta:
                    return None
                b = id(_base(x))
                parts.append(("T", tuple(x.shape), x.stride(), x.dtype, x.requires_grad, x._base is not None,
                              b in saved_ids, id(x) in param_ids))
            else:
                r = _scalar_repr(x)
                if r is None:
                    return None
                parts.append(r)
        return (op, str(spec), tuple(parts))

    def replay(self, key: tuple | None, ins: list[torch.Tensor], keep: list,
               saved_ids: set[int]) -> tuple[Any, int, int] | None:
        """(value, forward FLOPs, saved bytes) of a replayed run, or None to run the node.

        Marks the storages autograd would now hold in `saved_ids` (and keeps them alive in `keep`
        so their ids stay unique)."""
        rec = self._records.get(key) if key is not None else None
        if rec is None or rec is _NEVER:
            return None
        outs = []
        for o in rec.outputs:
            t = torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device="meta")
            if o.requires_grad:
                # a non-leaf, as the real output is: in-place ops on it must not meet a leaf
                t = t.requires_grad_().clone(memory_format=torch.preserve_format)
            outs.append(t)
        if any(t.stride() != o.stride for t, o in zip(outs, rec.outputs)):
            self._records[key] = _NEVER
            return None
        for t in [_base(ins[i]) for i in rec.saved_inputs] + [outs[i] for i in rec.saved_outputs]:
            saved_ids.add(id(t))
            keep.append(t)
        keep.extend(outs)
        return tree_unflatten(outs, rec.treedef), rec.flops, rec.saved

    def record(self, key: tuple | None, ins: list[torch.Tensor], value: Any, flops: int, saved: int,
               newly_saved: set[int]) -> None:
        """Remember a node's first run. `ins`: the tensor inputs in key order (`inputs`);
        `newly_saved`: the storage ids autograd began to hold."""
        if key is None or key in self._records:
            return
        leaves, treedef = tree_flatten(value)
        in_bases = {id(_base(x)) for x in ins}
        out_bases = [id(_base(t)) for t in leaves if isinstance(t, torch.Tensor)]
        if (not leaves or not all(isinstance(t, torch.Tensor) and t.is_meta for t in leaves)
                or len(set(out_bases)) != len(out_bases) or in_bases & set(out_bases)):
            self._records[key] = _NEVER
            return
        self._records[key] = _Record(
            treedef=treedef,
            outputs=tuple(_Output(tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in leaves),
            flops=int(flops), saved=int(saved),
            saved_inputs=tuple(i for i, x in enumerate(ins) if id(_base(x)) in newly_saved),
            saved_outputs=tuple(i for i, t in enumerate(leaves) if id(_base(t)) in newly_saved))
