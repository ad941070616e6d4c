"""The global gradient norm over the whole model, whatever the plan, each element counted once.

At the optimizer step a rank's gradients are those of the tensors its optimizer steps: whole
parameters (or their tensor-parallel slices), or under ZeRO its flat shard of each bucket.
The same logical element may live on several ranks (data replicas without ZeRO, a weight every
tensor rank holds whole, spatial tiles' replicated weights, the layers after a sub-graph join,
tied copies on two pipeline stages, two copies of a tied weight on one rank) and, at STEP, it
holds the same gradient on each of them: the data all-reduce (or reduce-scatter, for the shard
each data rank then owns alone), the tied-weight sum (runtime/execute/ties.py) and the tensor/sub-graph
collectives of backward (runtime/parallel/tensor/layers.py, runtime/parallel/subgraph/regions.py) leave every copy equal.

So each logical element is counted by one holder only. A `Piece` names what one optimizer
tensor holds: a range of elements [lo, hi) of one logical tensor, the logical tensor being the
model's canonical name and, for a tensor-parallel slice, the tensor rank whose slice it is.
At connect time every rank all-gathers its pieces (names hashed to int64), and an element is
owned by the first piece that holds it, in (rank, optimizer order). Per step each rank sums the
squares (float64) of the elements it owns and one all-reduce over the world gives the total.
ZeRO's bucket padding belongs to no piece and is never counted.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of logical tensor `key`, held by optimizer tensor `param` from element `at` on.

    key: canonical parameter name, with "@t<r>" for tensor rank r's slice of a split one.
    """

    key: str
    lo: int
    hi: int
    param: int
    at: int


def logical_key(canonical: str, tensor_rank: int | None) -> str:
    return canonical if tensor_rank is None else f"{canonical}@t{tensor_rank}"


def key_hash(key: str) -> int:
    """A stable 63-bit integer for a key (the ranks exchange integers, not strings)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def pieces_of(modules: dict, specs: dict, grads, tensor_rank: int) -> list[Piece]:
    """What each optimizer tensor of this rank holds, in GradSync.optimizer_params's order (or rank_main's
    list of whole parameters), not the optimizer's own (weight-decay groups reorder it): the params
    given to GlobalGradNorm.connect must be in this order."""

    def key(stage: int, name: str, p: torch.Tensor) -> str:
        sp = specs[stage]
        return logical_key(sp.canonical(name), tensor_rank if sp.split_of(name, p.dim()) is not None else None)

    out: list[Piece] = []
    if grads is not None and grads.shards:
        for i, st in enumerate(grads.states):
            k = st.grad_flat.numel() // grads.group.size
            lo = grads.group.rank * k
            off = 0
            for name, p in zip(st.bucket.params, st.params):
                n = p.numel()
                a, b = max(off, lo), min(off + n, lo + k)
                if a < b:
                    out.append(Piece(key(st.bucket.stage, name, p), a - off, b - off, i, a - lo))
                off += n
        return out
    seen: set[int] = set()
    index = 0
    for s in sorted(modules):
        for name, p in modules[s].named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(Piece(key(s, name, p), 0, p.numel(), index, 0))
                index += 1
    return out


def owned_ranges(everyone: list[list[tuple[int, int, int]]], rank: int,
                 mine: list[Piece]) -> list[tuple[int, int, int]]:
    """(optimizer tensor, start, end) element ranges this rank counts.

    everyone[r]: rank r's pieces as (key hash, lo, hi), in its optimizer order; `mine` is
    everyone[rank] with the local positions. An element is counted by the first piece that
    holds it in (rank, order): this rank's part of a piece is what no earlier piece covers.
    """
    earlier: dict[int, list[tuple[int, int]]] = {}
    for r in range(rank):
        for h, lo, hi in everyone[r]:
            earlier.setdefault(h, []).append((lo, hi))
    out = []
    for piece, (h, lo, hi) in zip(mine, everyone[rank]):
        free = [(lo, hi)]
        for a, b in earlier.get(h, []):
            free = [seg for fl, fh in free for seg in ((fl, min(fh, a)), (max(fl, b), fh)) if seg[0] < seg[1]]
        for a, b in free:
            out.append((piece.param, piece.at + a - lo, piece.at + b - lo))
        earlier.setdefault(h, []).append((lo, hi))
    return out


def _exchange(group, rows: list[tuple[int, int, int]], device) -> list[list[tuple[int, int, int]]]:
    """Every rank's rows over `group` (all ranks): two all-gathers, the counts then the padded rows."""
    size = group.size
    count = torch.tensor([len(rows)], dtype=torch.int64, device=device)
    counts = torch.zeros(size, dtype=torch.int64, device=device)
    group.all_gather(counts, count)
    width = max(1, int(counts.max()))
    mine = torch.full((width, 3), -1, dtype=torch.int64)
    if rows:
        mine[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
    allrows = torch.empty(size * width * 3, dtype=torch.int64, device=device)
    group.all_gather(allrows, mine.reshape(-1).to(device))
    table = allrows.view(size, width, 3).cpu()
    return [[tuple(int(x) for x in table[r, j]) for j in range(int(counts[r]))] for r in range(size)]


# ATen's CPU norm sums a tensor's squares into a few float32 accumulators, so its relative error grows
# with the tensor's size (one thread, measured: 3e-7 at 64Ki elements, 4e-6 at 1Mi, 5e-4 for GPT-2's
# 50257 x 256 embedding gradient), where a CUDA reduction's tree stays near float32's rounding. On a CPU a
# tensor of more than CPU_NORM_WHOLE elements is normed as rows of CPU_NORM_ROW (one kernel, no copy, as
# fast as the whole tensor's norm: 2.2 against 3.3 ms for that embedding) whose squares add up in float64.
CPU_NORM_WHOLE = 1 << 16
CPU_NORM_ROW = 1024


def _row_norms(t: torch.Tensor) -> list[torch.Tensor]:
    """1-D norms whose squares sum to the squared norm of `t` (a CPU tensor of more than CPU_NORM_WHOLE
    elements): one per row of CPU_NORM_ROW elements, and the remainder's."""
    flat = t.reshape(-1)
    n = flat.numel() // CPU_NORM_ROW * CPU_NORM_ROW
    out = [torch.linalg.vector_norm(flat[:n].view(-1, CPU_NORM_ROW), dim=1)]
    if n < flat.numel():
        out.append(torch.linalg.vector_norm(flat[n:]).reshape(1))
    return out


class GlobalGradNorm:
    """Sums of squares over the elements this rank counts, totalled over the world per step.

    Args:
        params: the optimizer's tensors (their .grad is read).
        ranges: owned_ranges' (tensor, start, end) element ranges.
        group: a group of all ranks; device: where the partial sum lives (NCCL reduces GPU tensors).
    """

    def __init__(self, params: list[torch.Tensor], ranges: list[tuple[int, int, int]], group, device):
        self._params = params
        self._ranges = ranges
        self._group = group
        self._device = torch.device(device)

    @classmethod
    def connect(cls, params: list[torch.Tensor], pieces: list[Piece], group, device) -> "GlobalGradNorm":
        """Exchange every rank's pieces (a collective over `group`, once) and keep this rank's share."""
        rows = [(key_hash(p.key), p.lo, p.hi) for p in pieces]
        everyone = _exchange(group, rows, device)
        return cls(params, owned_ranges(everyone, group.rank, pieces), group, device)

    def local_sum_of_squares(self) -> torch.Tensor:
        """This rank's share of the squared norm (float64, 0-dim); inf or NaN where a gradient has one.

        Each owned range's norm comes from one foreach kernel per dtype (in the gradient's dtype, as
        torch.nn.utils.get_total_norm computes it; a large CPU tensor by rows, see CPU_NORM_WHOLE),
        squared and summed in float64: no copy of a gradient is made (a float64 norm of a float32
        tensor would cast it first, and takes 15x as long on a CPU)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        norms: list[torch.Tensor] = []   # 1-D, of the large CPU tensors' rows
        for i, a, b in self._ranges:
            if (g := self._params[i].grad) is not None and b > a:
                # a whole tensor is normed as it is: a view and a slice per tensor cost as much host
                # time as its norm on a CPU (norms of the same elements, summed in the same order)
                t = g if b - a == g.numel() else g.reshape(-1)[a:b]
                if t.device.type == "cpu" and t.numel() > CPU_NORM_WHOLE:
                    norms.extend(_row_norms(t))
                else:
                    by_dtype.setdefault(g.dtype, []).append(t)
        sums = [torch.stack(torch._foreach_norm(group)).to(device=self._device, dtype=torch.float64).square().sum()
                for group in by_dtype.values()]
        if norms:
            sums.append(torch.cat(norms).to(device=self._device, dtype=torch.float64).square().sum())
        if len(sums) == 1:
            return sums[0]
        return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64, device=self._device)

    def compute_squared(self) -> torch.Tensor:
        """The squared L2 norm of the whole model's gradient, 0-dim float64 on the device, after one
        all-reduce over every rank (not read back: no host sync on a GPU)."""
        total = self.local_sum_of_squares().reshape(1)
        self._group.all_reduce(total)
        return total.reshape(())

    def compute(self) -> float:
        """The L2 norm of the whole model's gradient (one all-reduce over every rank); inf or NaN
        when any gradient element anywhere is."""
        total = float(self.compute_squared())
        return math.sqrt(total) if total >= 0 else total
