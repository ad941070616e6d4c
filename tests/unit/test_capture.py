"""planner.capture on the example zoo: shapes, FLOPs, parameters, layers, branches, errors."""

import json

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import planner
from examples.models import gpt, inception, large_image_cnn, mlp, resnet
from planner import CaptureError
from planner.graph.model import ModelGraph

ZOO = [
    (gpt, dict(preset="tiny")),
    (mlp, {}),
    (resnet, dict(depth=20)),
    (inception, {}),
    (large_image_cnn, dict(image_size=64)),
]


def _meta_model(mod, kw, batch=2):
    with torch.device("meta"):
        model = mod.build(**kw)
    return model, mod.example_inputs(batch_size=batch, device="meta", **kw)


def _flop_counter_total(model, inputs) -> int:
    with FlopCounterMode(display=False) as fc:
        model(*inputs)
    return fc.get_total_flops()


@pytest.mark.parametrize("mod,kw", ZOO, ids=[m.__name__.rsplit(".", 1)[-1] for m, _ in ZOO])
def test_zoo_totals_match_flop_counter_and_parameters(mod, kw):
    model, inputs = _meta_model(mod, kw)
    g = planner.capture(model, inputs)
    assert g.method == "fx"
    ref = _flop_counter_total(model, inputs)
    assert ref > 0
    assert abs(g.total_fwd_flops - ref) <= 0.01 * ref
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert g.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    # Training costs more than inference: backward is 1x-2x forward for these nets.
    assert g.total_fwd_flops < g.total_bwd_flops <= 2 * g.total_fwd_flops + 1
    # Nothing was allocated: every parameter stayed on meta.
    assert all(p.is_meta for p in model.parameters())


def test_real_model_is_analyzed_on_meta_and_left_unchanged():
    torch.manual_seed(0)
    model = mlp.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = mlp.example_inputs(batch_size=4)
    g = planner.capture(model, x)
    assert g.batch_size == 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert g.num_params == sum(p.numel() for p in model.parameters())


def test_opinfo_for_a_linear_layer():
    model, inputs = _meta_model(mlp, dict(in_features=16, hidden=32, num_layers=3, out_features=10), batch=4)
    g = planner.capture(model, inputs)
    lin = g.node("net_0")
    assert lin.kind == "linear" and lin.module_path == "net.0" and lin.target == "torch.nn.Linear"
    assert lin.input_meta[0].shape == (4, 16) and lin.output_meta[0].shape == (4, 32)
    assert lin.output_meta[0].dtype == "float32"
    assert lin.fwd_flops == 2 * 4 * 16 * 32
    # The first layer needs no input gradient: only the weight gradient (same FLOPs as forward).
    assert lin.bwd_flops == 2 * 4 * 16 * 32
    second = g.node("net_2")
    assert second.bwd_flops == 2 * second.fwd_flops  # input and weight gradients
    assert lin.param_count == 16 * 32 + 32 and lin.param_bytes == 4 * (16 * 32 + 32)
    assert lin.param_names == ("net.0.weight", "net.0.bias")
    assert lin.output_bytes == 4 * 32 * 4
    assert lin.bytes_read == 4 * 16 * 4 + lin.param_bytes and lin.bytes_written == lin.output_bytes
    relu = g.node("net_1")
    assert relu.kind == "elementwise" and relu.fwd_flops == 0 and relu.param_count == 0


def test_gpt_layers_repeat_with_one_signature_and_heads_are_branches():
    kw = dict(preset="tiny", num_layers=3)
    model, inputs = _meta_model(gpt, kw)
    g = planner.capture(model, inputs)
    names = [layer.name for layer in g.layers]
    assert [n for n in names if n.startswith("blocks.")] == ["blocks.0", "blocks.1", "blocks.2"]
    blocks = [layer for layer in g.layers if layer.name.startswith("blocks.")]
    assert len({b.signature for b in blocks}) == 1
    assert all(len(b.boundary) == 1 for b in blocks)
    cfg = gpt.make_config("tiny", num_layers=3)
    b, t, h = 2, cfg.seq_len, cfg.hidden
    assert blocks[0].boundary_bytes == b * t * h * 4  # the residual stream crosses each cut
    # Every node is in exactly one layer, in graph order.
    flat = [n for layer in g.layers for n in layer.nodes]
    assert sorted(flat) == sorted(n.name for n in g.nodes)
    heads = [br for br in g.branches if br.kind == "heads"]
    assert len(heads) == 3 and all(br.width == cfg.num_heads for br in heads)
    assert sum(layer.param_count for layer in g.layers) == g.num_params


def test_inception_branches_are_found():
    model, inputs = _meta_model(inception, dict(num_modules=2))
    g = planner.capture(model, inputs)
    par = [br for br in g.branches if br.kind == "parallel"]
    assert len(par) == 2
    for br in par:
        assert br.width == 4
        assert g.node(br.join).kind == "concat"
        # The four paths are disjoint and each starts at the fork.
        seen = set()
        for path in br.paths:
            assert not seen & set(path)
            seen |= set(path)
        # Each path is one of the module's four branch submodules b1..b4.
        owners = set()
        for path in br.paths:
            subs = {g.node(n).module_path.split(".")[2] for n in path if g.node(n).module_path.count(".") >= 2}
            assert len(subs) == 1
            owners |= subs
        assert owners == {"b1", "b2", "b3", "b4"}
        # in graph order (the paths of a plan file must not depend on set order)
        index = {n.name: i for i, n in enumerate(g.nodes)}
        firsts = [index[p[0]] for p in br.paths]
        assert firsts == sorted(firsts)


def test_resnet_1001_captures_on_meta():
    model, inputs = _meta_model(resnet, dict(depth=1001), batch=1)
    g = planner.capture(model, inputs)
    assert g.num_params == sum(p.numel() for p in model.parameters())
    blocks = [layer for layer in g.layers if layer.name.startswith("stages.")]
    assert len(blocks) == 333  # 3 stages x 111 bottleneck blocks
    assert len(g.unique_layers()) < 20


def test_json_round_trip(tmp_path):
    model, inputs = _meta_model(gpt, dict(preset="tiny"))
    g = planner.capture(model, inputs)
    path = tmp_path / "graph.json"
    g.save(path)
    back = ModelGraph.load(path)
    assert back == g
    assert json.loads(path.read_text())["format_version"] == 1


def test_fingerprint_is_stable_and_tracks_structure():
    a = planner.capture(*_meta_model(gpt, dict(preset="tiny")))
    b = planner.capture(*_meta_model(gpt, dict(preset="tiny"), batch=4))
    c = planner.capture(*_meta_model(gpt, dict(preset="tiny", num_layers=3)))
    assert a.fingerprint == b.fingerprint  # the batch size does not change the model
    assert a.fingerprint != c.fingerprint


def test_summary_mentions_the_essentials():
    g = planner.capture(*_meta_model(gpt, dict(preset="tiny")))
    text = g.summary()
    assert "parameters: " in text and "blocks.1" in text and "GPT" in text


def test_batch_dim():
    model, _ = _meta_model(mlp, {})
    seq_first = planner.capture(*_meta_model(gpt, dict(preset="tiny"), batch=3), batch_dim=1)
    assert seq_first.batch_size == gpt.make_config("tiny").seq_len  # (B, T) read with dim 1 as samples
    g = planner.capture(model, torch.empty(7, 16, device="meta"), batch_dim=0)
    assert g.batch_size == 7
    with pytest.raises(CaptureError, match="batch_dim=3"):
        planner.capture(model, torch.empty(7, 16, device="meta"), batch_dim=3)


# ---- errors ---------------------------------------------------------------


def test_not_a_module():
    with pytest.raises(CaptureError, match="expects a torch.nn.Module.*GPTConfig"):
        planner.capture(gpt.make_config("tiny"), (torch.zeros(1, 4, dtype=torch.long),))
    with pytest.raises(ValueError, match="not its class"):
        planner.capture(gpt.GPT, ())


def test_inputs_that_do_not_match_forward():
    model, _ = _meta_model(mlp, {})
    with pytest.raises(CaptureError, match=r"do not match MLP.forward"):
        planner.capture(model, (torch.empty(2, 16), torch.empty(2, 16)))
    with pytest.raises(CaptureError, match=r"do not match"):
        planner.capture(model, {"nope": torch.empty(2, 16)})
    # Right arity, wrong feature size: names the node and the shapes.
    with pytest.raises(CaptureError, match=r"net_0.*\(2, 15\)"):
        planner.capture(model, torch.empty(2, 15, device="meta"))
    with pytest.raises(CaptureError, match="must be a tensor"):
        planner.capture(model, 3.0)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # depends on values: neither tracer can follow it on meta
            return self.lin(x)
        return x


def test_untraceable_model_names_class_place_and_both_errors():
    with pytest.raises(CaptureError) as info:
        planner.capture(_DataDependent(), torch.zeros(2, 4))
    msg = str(info.value)
    assert "_DataDependent" in msg
    assert "torch.fx.symbolic_trace" in msg and "torch.export.export" in msg
    assert "test_capture.py" in msg and "x.sum() > 0" in msg  # where tracing stopped


class _NeedsExport(nn.Module):
    """fx cannot iterate a proxy's shape; torch.export can."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        b, t, c = x.shape
        parts = [self.lin(x[:, i]) for i in range(t)]
        return torch.stack(parts, dim=1).reshape(b, t * c)


def test_export_fallback():
    model = _NeedsExport()
    x = torch.zeros(2, 3, 8)
    g = planner.capture(model, x)
    assert g.method == "export"
    with FlopCounterMode(display=False) as fc:
        model(x)
    assert g.total_fwd_flops == fc.get_total_flops()
    assert g.num_params == 8 * 8 + 8
