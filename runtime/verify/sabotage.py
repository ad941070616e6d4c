"""Deliberate faults for tests of `meshplan run --verify` (rank option --sabotage).

A check that never fails proves nothing: each sabotage removes one piece of the parallel
arithmetic while every rank still sends and receives what its peers expect (no hang), so
the run finishes and only the numbers are wrong.

  drop-bucket     gradient bucket 0 is reduced into a scratch copy: its parameters keep this
                  rank's own gradient instead of the sum over the data ranks
  skip-tied-sum   the copies of a tied weight keep their own stage's gradient

and those the strategies offer (runtime/parallel/, their `sabotages`; spatial's drop-halo-grad: a
tile ignores the gradients its neighbours return for the halo rows they borrowed).
"""

from __future__ import annotations

from torch import nn

from runtime.parallel.registry import STRATEGIES

SABOTAGE = ("drop-bucket", "skip-tied-sum", *(w for s in STRATEGIES for w in s.sabotages))


def sabotage(what: str | None, grads, ties, modules: dict[int, nn.Module]) -> None:
    """Break the rank's run as `what` says (None: nothing)."""
    if what is None:
        return
    if what == "drop-bucket" and grads is not None and grads.states:
        grads.dropped.add(0)
    elif what == "skip-tied-sum" and ties is not None:
        ties.skip_sum = True
    else:
        for s in STRATEGIES:
            if what in s.sabotages:
                s.sabotage(what, modules)
