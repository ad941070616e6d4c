"""planner/graph/replay.py: a capture that replays repeated nodes gives the same ModelGraph as one
that runs every node.

The models cover both tracers (fx for the example GPT, ResNet and Inception; torch.export for the
Hugging Face models), repeated blocks, views and in-place ops, batch norm (whose running
statistics autograd saves), a module called twice, and dropout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import planner
from examples.models import gpt, hf, inception, resnet
from planner.graph import replay
from planner.graph.replay import ForwardMemo


def _without_replay(monkeypatch, model, inputs):
    with monkeypatch.context() as m:
        m.setattr(ForwardMemo, "key", lambda self, *a, **k: None)
        return planner.capture(model, inputs)


class _Twice(nn.Module):
    """One BatchNorm and one Linear each called twice, an in-place ReLU, and repeated blocks."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)
        self.fc = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Dropout(0.1))
                                    for _ in range(3))

    def forward(self, x):
        x = self.bn(self.fc(x))
        x = self.bn(self.fc(x))
        for b in self.blocks:
            x = x + b(x)
        return x.view(x.shape[0], 2, 4).transpose(1, 2).sum(-1)


CASES = {
    "twice": (lambda: _Twice(), lambda: torch.randn(4, 8)),
    "gpt": (lambda: gpt.build(), lambda: gpt.example_inputs(batch_size=2)),
    "resnet": (lambda: resnet.build(depth=20), lambda: resnet.example_inputs(batch_size=2, depth=20)),
    "inception": (lambda: inception.build(), lambda: inception.example_inputs(batch_size=2)),
    "hf-llama": (lambda: hf.build(arch="llama"), lambda: hf.example_inputs(batch_size=2, arch="llama")),
    "hf-bert": (lambda: hf.build(arch="bert"), lambda: hf.example_inputs(batch_size=2, arch="bert")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_replayed_capture_equals_a_full_run(name, monkeypatch):
    build, inputs = CASES[name]
    torch.manual_seed(0)
    model, x = build(), inputs()
    replayed = planner.capture(model, x)
    full = _without_replay(monkeypatch, model, x)
    assert replayed.to_dict() == full.to_dict()


def test_replays_happen_and_views_run_every_time(monkeypatch):
    """The example GPT's blocks are replayed: fewer real runs than nodes, and every view runs."""
    runs: list[str] = []
    real = replay.ForwardMemo.record

    def counting(self, key, ins, value, *a):
        runs.append(key[0] if key else None)
        return real(self, key, ins, value, *a)

    monkeypatch.setattr(replay.ForwardMemo, "record", counting)
    model = gpt.build(num_layers=4)
    graph = planner.capture(model, gpt.example_inputs(batch_size=2, num_layers=4))
    computed = [n for n in graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    assert len(graph.layers) >= 4 and 0 < len(runs) < len(computed)
    views = [n for n in computed if n.op == "call_method" and n.target in ("transpose", "unflatten", "permute")]
    assert views and sum(r is not None and r[0] == "method" and r[1] in ("transpose", "unflatten", "permute")
                         for r in runs) == len(views)   # views run every time


def test_a_view_output_is_never_replayed():
    memo = ForwardMemo()
    x = torch.empty(2, 3, device="meta")
    node = type("N", (), {"op": "call_method", "target": "view"})()
    key = memo.key(node, None, (x, 3, 2), {}, [], set(), set())
    y = x.view(3, 2)
    memo.record(key, [x], y, 0, 0, set())
    assert memo.replay(key, [x], [], set()) is None


def test_a_fresh_output_is_replayed_with_its_flops_saved_bytes_and_autograd_state():
    memo = ForwardMemo()
    a = torch.empty(4, 5, device="meta", requires_grad=True)
    b = torch.empty(5, 6, device="meta")
    node = type("N", (), {"op": "call_function", "target": torch.matmul})()
    key = memo.key(node, None, (a, b), {}, [], set(), set())
    out = torch.matmul(a, b)
    # autograd saved b (for a's gradient): the first run's record says so by position
    memo.record(key, [a, b], out, 240, 120, {id(b)})
    a2 = torch.empty(4, 5, device="meta", requires_grad=True)
    b2 = torch.empty(5, 6, device="meta")
    saved: set[int] = set()
    assert memo.key(node, None, (a2, b2), {}, [], saved, set()) == key
    value, flops, nbytes = memo.replay(key, [a2, b2], [], saved)
    assert (tuple(value.shape), value.dtype, value.requires_grad, value.is_leaf) == ((4, 6), torch.float32, True, False)
    assert (flops, nbytes) == (240, 120)
    assert saved == {id(b2)}
    # once b2's storage is held, the signature differs: its first run decides again
    assert memo.key(node, None, (a2, b2), {}, [], saved, set()) != key


def test_an_argument_without_a_faithful_repr_is_never_replayed():
    memo = ForwardMemo()
    node = type("N", (), {"op": "call_function", "target": torch.add})()
    x = torch.empty(2, device="meta")
    assert memo.key(node, None, (x, object()), {}, [], set(), set()) is None
    assert memo.key(node, None, (torch.empty(2), x), {}, [], set(), set()) is None   # a tensor off meta
