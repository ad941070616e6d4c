"""Context parallelism's attention exchange, priced: ring attention and Ulysses all-to-all.

Under context parallelism of degree c every rank holds T/c tokens of each sequence (in the
causal load-balanced order: rank r holds chunks r and 2c-1-r of 2c equal chunks, so every rank
does the same share of the masked attention work). Attention must still see every key:

- Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", section 3):
  c-1 steps; at each step a rank sends its current key/value block to the next rank of the
  ring while it computes attention on the block it holds, so a step exposes only what its
  transfer takes beyond the step's share of the attention compute. The first transfer's
  latency is exposed: nothing precedes it to hide behind. Backward passes the key/value blocks
  and their gradients dK, dV around the ring: twice the forward traffic per step.
- Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses", section 3.1): an all-to-all over the c
  ranks before attention turns q, k and v from a sequence split into a head split, one after it
  turns the output back; backward mirrors them (the output gradient in, dq, dk, dv back). The
  attention waits on them: nothing is overlapped.

Pure functions of seconds and bytes; the planner (planner/strategies/context/strategy.py) gives them the
context axis' link prices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ExchangeSeconds:
    """Exposed seconds of one layer's context-parallel attention exchange, one micro-batch, one rank."""

    forward: float
    backward: float


def ring_exposed(steps: int, transfer: float, latency: float, compute: float) -> float:
    """Exposed seconds of a ring of `steps` transfers, each of `transfer` s (latency included), each
    overlapped with one block of attention compute of `compute` s: the first transfer's `latency`
    plus, per step, whatever the transfer takes beyond the block's compute."""
    if steps <= 0:
        return 0.0
    return latency + steps * max(0.0, transfer - compute)


def ring_attention(c: int, kv_bytes: float, p2p: Callable[[float], float], attention_forward: float,
                   attention_backward: float) -> ExchangeSeconds:
    """Ring attention's exposed seconds for one attention op on one rank.

    Args:
        c: context-parallel degree (ranks in the ring).
        kv_bytes: bytes of the local key and value blocks together (2 x B x T/c x H_kv x D x
            element bytes, H_kv the key/value heads on this tensor rank).
        p2p: seconds to send n bytes to the ring's next rank (latency included; p2p(0) is taken
            as 0, so the latency is p2p of one byte).
        attention_forward, attention_backward: this rank's attention compute (seconds) in forward and
            backward, 1/c of the whole attention (load-balanced causal split); each of the c blocks
            takes 1/c of it.
    """
    if c <= 1:
        return ExchangeSeconds(0.0, 0.0)
    latency = p2p(1.0)
    fwd = ring_exposed(c - 1, p2p(kv_bytes), latency, attention_forward / c)
    bwd = ring_exposed(c - 1, p2p(2 * kv_bytes), latency, attention_backward / c)
    return ExchangeSeconds(fwd, bwd)


def ulysses(c: int, qkv_bytes: tuple[float, ...], out_bytes: float,
            all_to_all: Callable[[float], float]) -> ExchangeSeconds:
    """Ulysses' seconds for one attention op on one rank: one all-to-all per tensor of q, k, v
    (`qkv_bytes`, each what this rank holds: B x T/c x heads x D x element bytes) and one of the output
    (`out_bytes`) in forward, the same four in backward; `all_to_all(n)` prices one over the context
    axis (a rank holding n bytes sends (c-1)/c of them). None is overlapped."""
    if c <= 1:
        return ExchangeSeconds(0.0, 0.0)
    seconds = sum(all_to_all(n) for n in qkv_bytes) + all_to_all(out_bytes)
    return ExchangeSeconds(seconds, seconds)
