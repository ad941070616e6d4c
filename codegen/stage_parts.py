"""A strategy's part in one stage's code: the protocol codegen/stage_source.py writes a stage through.

The stage writer copies each layer's captured nodes into the layer's method. A strategy that
changes how some layers run hands the writer a `StageCodePart` for the stage (codegen/partition.py
makes them: sub-graph parallelism's regions, codegen/strategies/subgraph/regions.py; spatial
parallelism's tiles, codegen/strategies/spatial/tiles.py), and the writer asks each, in order:

    layer(L, body)          before layer L: whether this part changes L's method (a changed method is
                            never shared between the copies of a repeated block); the next three are
                            asked only of the parts that change it:
    writes(name)            whether it writes node `name` of that layer itself (the writer then copies
                            nothing for it);
    write(name, lg, env, need)   writes it into the layer graph `lg` (env: value name -> its node there;
                            need(value): make `value` an input of the method unless the layer made it);
                            returns the globals its code reads;
    copy(lg, n, arg)        n's node in `lg` where this part rewrites it (arg: an input's node), else None;
    after(i, layers, produced_in, needed_after)   the forward's lines right after the call of the
                            stage's i-th layer (layers: the stage's, in order; produced_in: value -> its
                            layer; needed_after: value -> index of the last layer that reads it);
    finish()                (method sources added after the layer methods, __init__ lines, their globals).
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx


class StageCodePart:
    """One strategy's part in one stage's code (module docstring); subclass it and override what the
    strategy changes (by default it changes no layer and adds nothing)."""

    def layer(self, name: str, body: list[fx.Node]) -> bool:
        return False

    def writes(self, name: str) -> bool:
        return False

    def write(self, name: str, lg: fx.Graph, env: dict[str, fx.Node], need: Callable[[str], None]) -> dict:
        return {}

    def copy(self, lg: fx.Graph, n: fx.Node, arg: Callable[[fx.Node], fx.Node]) -> fx.Node | None:
        return None

    def after(self, i: int, layers: list[str], produced_in: dict[str, str],
              needed_after: dict[str, int]) -> list[str]:
        return []

    def finish(self) -> tuple[list[str], list[str], dict]:
        return [], [], {}


__all__ = ["StageCodePart"]
