"""The example model zoo (examples/models): shapes, fx traceability, meta builds,
parameter counts, deterministic synthetic data and config validation."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from examples.models import gpt, inception, large_image_cnn, mlp, resnet

# (module, tiny kwargs shared by build/example_inputs/example_batch, expected output
# shape for batch 2)
TINY = {
    "mlp": (mlp, dict(in_features=6, hidden=8, num_layers=3, out_features=5), (2, 5)),
    "gpt": (gpt, dict(preset="tiny"), (2, 16, 128)),
    "resnet": (resnet, dict(depth=8, width=4, image_size=8, num_classes=7), (2, 7)),
    "resnet_bottleneck": (resnet, dict(depth=11, block="bottleneck", width=2,
                                       image_size=8, num_classes=3), (2, 3)),
    "resnet_imagenet": (resnet, dict(depth=8, width=4, image_size=32, stem="imagenet",
                                     num_classes=4), (2, 4)),
    "inception": (inception, dict(num_modules=2, channels=4, stem_channels=4,
                                  image_size=8, num_classes=6), (2, 6)),
    "large_image_cnn": (large_image_cnn, dict(image_size=16, num_classes=3), (2, 3)),
}


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _count(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


@pytest.mark.parametrize("name", sorted(TINY))
def test_forward_shape(name):
    module, kwargs, expected = TINY[name]
    torch.manual_seed(0)
    model = module.build(**kwargs)
    inputs = module.example_inputs(2, "cpu", **kwargs)
    assert isinstance(inputs, tuple) and all(isinstance(t, torch.Tensor) for t in inputs)
    out = model(*inputs)
    assert out.shape == expected
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(TINY))
def test_fx_trace_matches_eager(name):
    module, kwargs, _ = TINY[name]
    torch.manual_seed(0)
    model = module.build(**kwargs).eval()
    traced = torch.fx.symbolic_trace(model)
    inputs = module.example_inputs(2, "cpu", **kwargs)
    with torch.no_grad():
        torch.testing.assert_close(traced(*inputs), model(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(TINY))
def test_build_on_meta_and_deterministic_init(name):
    module, kwargs, expected = TINY[name]
    with torch.device("meta"):
        meta_model = module.build(**kwargs)
    assert all(p.is_meta for p in meta_model.parameters())
    assert meta_model(*module.example_inputs(2, "meta", **kwargs)).shape == expected
    torch.manual_seed(3)
    a = module.build(**kwargs)
    torch.manual_seed(3)
    b = module.build(**kwargs)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb
        assert torch.equal(pa, pb), na
    assert _num_params(a) == _num_params(meta_model)


@pytest.mark.parametrize("name", sorted(TINY))
def test_example_batch_deterministic_per_seed(name):
    module, kwargs, expected = TINY[name]
    (x1, *_), y1 = module.example_batch(4, seed=7, **kwargs)
    (x2, *_), y2 = module.example_batch(4, seed=7, **kwargs)
    (x3, *_), y3 = module.example_batch(4, seed=8, **kwargs)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert y1.dtype == torch.long and x1.shape[0] == 4
    # Targets fit cross-entropy against the model's logits.
    torch.manual_seed(0)
    logits = module.build(**kwargs)(x1)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y1.reshape(-1))
    assert torch.isfinite(loss)
    assert int(y1.min()) >= 0 and int(y1.max()) < logits.shape[-1]


# ----- MLP -----

def test_mlp_module_paths():
    model = mlp.build(in_features=4, hidden=8, num_layers=3, out_features=2)
    names = [n for n, _ in model.named_modules() if n]
    assert names == ["net", "net.0", "net.1", "net.2", "net.3", "net.4"]
    assert isinstance(model.net[0], nn.Linear) and isinstance(model.net[1], nn.ReLU)
    assert isinstance(mlp.build(num_layers=1).net[0], nn.Linear)


def test_mlp_bad_config():
    with pytest.raises(ValueError, match="num_layers"):
        mlp.build(num_layers=0)


# ----- GPT -----

@pytest.mark.parametrize("overrides", [{}, dict(bias=False), dict(mlp_ratio=2, num_layers=3)])
def test_gpt_num_params_tiny(overrides):
    model = gpt.build(preset="tiny", **overrides)
    assert gpt.num_params(model.config) == _num_params(model)


def test_gpt_num_params_1t_on_meta():
    with torch.device("meta"):
        model = gpt.build(preset="1t")
    count = _num_params(model)
    assert count == gpt.num_params(model.config)
    cfg = model.config
    assert count > 12 * cfg.num_layers * cfg.hidden ** 2
    assert 1.0e12 <= count <= 1.02e12


def test_gpt_presets_and_overrides():
    assert gpt.make_config() == gpt.make_config("tiny")
    cfg = gpt.make_config("gpt3-175b")
    assert (cfg.hidden, cfg.num_layers, cfg.num_heads) == (12288, 96, 96)
    assert 174e9 < gpt.num_params(cfg) < 176e9
    assert 529e9 < gpt.num_params(gpt.make_config("megatron-530b")) < 532e9
    model = gpt.build(preset="small", num_layers=1, hidden=64)
    assert model.config.num_layers == 1 and model.config.hidden == 64
    assert model.config.vocab_size == 512 and len(model.blocks) == 1


def test_gpt_module_paths_and_no_tying():
    model = gpt.build()
    names = dict(model.named_modules())
    for path in ("blocks.1.attn.qkv", "blocks.1.attn.proj", "blocks.0.mlp.fc",
                 "blocks.0.ln1", "ln_f", "lm_head", "wte", "wpe"):
        assert path in names, path
    assert model.lm_head.weight is not model.wte.weight
    assert names["blocks.0.attn.qkv"].out_features == 3 * model.config.hidden


def test_gpt_shorter_sequence_and_causality():
    torch.manual_seed(0)
    model = gpt.build().eval()
    (idx,), _ = gpt.example_batch(2, seed=0)
    full = model(idx)
    prefix = model(idx[:, :5])                      # T < seq_len works
    torch.testing.assert_close(prefix, full[:, :5], rtol=1e-5, atol=1e-5)


def test_gpt_example_batch_is_next_token():
    (idx,), targets = gpt.example_batch(3, seed=1, preset="tiny")
    assert idx.shape == targets.shape == (3, 16)
    assert torch.equal(idx[:, 1:], targets[:, :-1])


def test_gpt_bad_configs():
    with pytest.raises(ValueError, match=r"hidden=30.*num_heads=4"):
        gpt.build(hidden=30)
    with pytest.raises(ValueError, match="unknown preset"):
        gpt.build(preset="huge")
    with pytest.raises(ValueError, match="num_layers"):
        gpt.build(num_layers=0)
    with pytest.raises(ValueError, match="unknown config field"):
        gpt.make_config(n_embd=32)


# ----- ResNet -----

@pytest.mark.parametrize("depth,block,convs", [(110, "basic", 111), (1001, "bottleneck", 1003),
                                                (164, "bottleneck", 166)])
def test_resnet_deep_on_meta(depth, block, convs):
    with torch.device("meta"):
        model = resnet.build(depth=depth)
    assert model.block == block
    assert _count(model, nn.Conv2d) == convs == resnet.num_convs(depth)
    assert _count(model, nn.Linear) == 1
    n = (depth - 2) // (6 if block == "basic" else 9)
    assert [len(s) for s in model.stages] == [n, n, n]
    # Projection shortcuts only where the shape changes.
    assert model.stages[1][0].shortcut is not None
    assert model.stages[1][1].shortcut is None
    assert (model.stages[0][0].shortcut is not None) == (block == "bottleneck")
    assert model.fc.in_features == 64 * (4 if block == "bottleneck" else 1)


def test_resnet_preactivation_layout():
    model = resnet.build(depth=20)
    unit = model.stages[0][0]
    assert [n for n, _ in unit.named_children()][:3] == ["bn1", "relu1", "conv1"]
    assert "stages.2.2.conv2" in dict(model.named_modules())
    with torch.device("meta"):
        big = resnet.build(depth=8, stem="imagenet")
    out = big(*resnet.example_inputs(1, "meta", image_size=224, stem="imagenet"))
    assert out.shape == (1, 10)


def test_resnet_bad_depth():
    for depth in (21, 100, 5):
        with pytest.raises(ValueError, match=r"6n\+2"):
            resnet.build(depth=depth)
    with pytest.raises(ValueError, match="bottleneck"):
        resnet.build(depth=26, block="bottleneck")
    with pytest.raises(ValueError, match="stem"):
        resnet.build(stem="tiny")


# ----- Inception -----

def test_inception_branches():
    model = inception.build(num_modules=3, channels=8)
    names = dict(model.named_modules())
    for i in range(3):
        for b in ("b1", "b2", "b3", "b4"):
            assert f"blocks.{i}.{b}" in names
    assert isinstance(model.blocks[0].b4[0], nn.MaxPool2d)
    assert model.blocks[0].out_channels == 8 + 16 + 4 + 4
    traced = torch.fx.symbolic_trace(model)
    cats = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is torch.cat]
    assert len(cats) == 3


def test_inception_bad_config():
    with pytest.raises(ValueError, match="channels"):
        inception.build(channels=0)


# ----- Large-image CNN -----

def test_large_image_cnn_16k_on_meta():
    with torch.device("meta"):
        model = large_image_cnn.build(image_size=16384)
    (x,) = large_image_cnn.example_inputs(1, "meta", image_size=16384)
    assert x.shape == (1, 3, 16384, 16384)
    assert model(x).shape == (1, 10)
    assert large_image_cnn.output_size(16384) == 16384 // 4 // 2
    kernels = {m.kernel_size[0] for m in model.modules() if isinstance(m, nn.Conv2d)}
    assert kernels == {1, 3, 5}
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            assert m.padding[0] == (m.kernel_size[0] - 1) // 2


def test_large_image_cnn_bad_config():
    with pytest.raises(ValueError, match="kernel_size=2"):
        large_image_cnn.build(layers=[(8, 2, 1)])
    with pytest.raises(ValueError, match="stride=3"):
        large_image_cnn.build(layers=[(8, 3, 3)])
    with pytest.raises(ValueError, match="too small"):
        large_image_cnn.build(image_size=4, layers=[(8, 3, 2), (8, 3, 2)])
    with pytest.raises(ValueError, match="empty"):
        large_image_cnn.build(layers=[])
