"""Capture finds where a model draws random numbers, inside the modules it keeps whole too
(planner/graph/randomness.py), and --verify says that rules out a sample-exact check instead of
reporting a mismatch (runtime/verify/__init__.py)."""

from __future__ import annotations

import json

import torch
from torch import nn

import planner
from examples.models import minimal
from planner.graph.capture import capture_ref
from runtime.verify import random_ops_problem, verify_build
from runtime.verify.verification import Verification

MINIMAL = "examples/models/minimal.py:build"


def test_dropout_inside_torchs_transformer_encoder_is_found_by_its_modules():
    """nn.TransformerEncoder is one leaf node in the graph: its layers' dropouts are read from the modules."""
    graph = capture_ref(MINIMAL, {"dropout": 0.1}, batch_size=2)
    assert [n.target for n in graph.nodes if n.module_path == "encoder"] == ["torch.nn.TransformerEncoder"]
    assert "encoder.layers.0.dropout1 (dropout p=0.1)" in graph.random_ops
    assert "encoder.layers.1.self_attn (attention dropout p=0.1)" in graph.random_ops
    assert len(graph.random_ops) == 8      # per layer: attention, the feed-forward's and both residual dropouts
    assert capture_ref(MINIMAL, {}, batch_size=2).random_ops == ()     # dropout 0: nothing drawn


def test_the_same_leaf_with_torchs_default_dropout_built_on_the_cpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))   # p=0.1
    graph = planner.capture(model, torch.zeros(2, 5, dtype=torch.long))
    assert "1.dropout (dropout p=0.1)" in graph.random_ops
    model.eval()   # the run trains: a model captured in eval mode still draws in training
    assert planner.capture(model, torch.zeros(2, 5, dtype=torch.long)).random_ops == graph.random_ops


class _Pools(nn.Module):
    """Two leaf modules that draw random samples without a dropout attribute: only the op stream shows them.
    The second is a repeat of the first (same signature), which capture replays instead of running."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)
        self.pool1 = nn.FractionalMaxPool2d(2, output_size=(8, 8))
        self.pool2 = nn.FractionalMaxPool2d(2, output_size=(8, 8))

    def forward(self, x):
        return (self.pool1(self.conv1(x)) + self.pool2(self.conv2(x))).flatten(1)


def test_random_draws_no_setting_names_are_found_in_the_op_stream_also_when_replayed():
    graph = planner.capture(_Pools(), torch.zeros(2, 3, 16, 16))
    pools = [o for o in graph.random_ops if o.startswith("pool")]
    assert len(pools) == 2 and all("rand" in o for o in pools), graph.random_ops
    assert planner.capture(nn.Sequential(nn.Conv2d(3, 3, 1), nn.MaxPool2d(2)), torch.zeros(2, 3, 8, 8)).random_ops == ()


def test_functional_dropout_in_a_traced_forward_is_found_by_its_node():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return nn.functional.dropout(self.fc(x), p=0.25, training=self.training)

    assert planner.capture(Net(), torch.zeros(2, 4)).random_ops == ("dropout (dropout p=0.25)",)


def test_graph_json_keeps_the_random_ops():
    graph = capture_ref(MINIMAL, {"dropout": 0.1}, batch_size=2)
    again = type(graph).from_dict(json.loads(json.dumps(graph.to_dict())))
    assert again.random_ops == graph.random_ops
    doc = graph.to_dict()
    del doc["random_ops"]    # a graph.json written before they were recorded
    assert type(graph).from_dict(doc).random_ops == ()


def test_verify_says_not_applicable_instead_of_a_mismatch(tmp_path):
    ops = ["encoder.layers.0.dropout1 (dropout p=0.1)"] * 2 + [f"x{k} (rand)" for k in range(3)]
    (tmp_path / "build.json").write_text(json.dumps({"train": _train(), "random_ops": ops}))
    cmp = verify_build(tmp_path, 1, {0: [1.0]})
    assert isinstance(cmp, Verification) and not cmp.ok and cmp.inapplicable
    text = cmp.summary()
    assert text.startswith("NOT APPLICABLE: the model draws random numbers in training (encoder.layers.0.dropout1 "
                           "(dropout p=0.1)")
    assert "and 2 more" in text and "MISMATCH" not in text and "differs" not in text
    assert random_ops_problem({"random_ops": []}) is None


def _train() -> dict:
    from runtime.spec import TrainSpec

    return TrainSpec(model_ref=f"{minimal.__file__}:build", data_ref=f"{minimal.__file__}:example_batch",
                     global_batch_size=4).to_dict()
