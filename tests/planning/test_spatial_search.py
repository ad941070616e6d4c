"""The joint search with spatial splitting, on meta-captured CNNs.

ResNet-v2-110 on 16384 x 16384 images does not fit 48 V100s (8 Summit nodes) with any data x
pipeline x tensor plan: one residual unit's activations exceed 16 GiB. With spatial tiles the
search finds a plan that fits. Models without convolutions search exactly what they did before.
"""


import pytest
import torch

import planner
from planner.evaluator import Evaluator
from examples.models import gpt, resnet
from planner import NoFeasiblePlan
from planner.search import _enumerate


@pytest.fixture(scope="module")
def resnet_16k():
    model = resnet.build(depth=110, width=16, image_size=16384)
    return planner.capture(model, resnet.example_inputs(1, "meta", image_size=16384))


def test_16k_resnet_fits_only_with_spatial_tiles(resnet_16k):
    cluster = planner.Cluster.preset("summit", nodes=8)
    with pytest.raises(NoFeasiblePlan):
        planner.optimize(resnet_16k, cluster, global_batch_size=1, constraints={"spatial": 1}, runtime=None)
    plan = planner.optimize(resnet_16k, cluster, global_batch_size=1, runtime=None)
    c = plan.config
    assert c.spatial > 1 and plan.prediction.fits
    assert plan.prediction.peak_memory <= cluster.device.memory_bytes
    assert c.spatial_until in [layer.name for layer in resnet_16k.layers]
    assert planner.Plan.from_dict(plan.to_dict()).config == c


def test_runtime_support_allows_spatial_only_as_lowered():
    from planner.capabilities import MESHPLAN_RUNTIME

    ok = planner.ParallelConfig(data=2, spatial=2, spatial_until="stem.0", dtype="fp32")
    assert MESHPLAN_RUNTIME.allows(ok)
    assert MESHPLAN_RUNTIME.allows(ok.replace(pipeline=2))
    assert MESHPLAN_RUNTIME.allows(ok.replace(pipeline=2, bidirectional=True))
    assert MESHPLAN_RUNTIME.allows(ok.replace(zero=3))
    for change, word in ((dict(pipeline=2, schedule="interleaved", virtual_stages=2), "interleaved"), (dict(recompute="full"), "recompute 'full'"),
                         (dict(tensor=2), "tensor 2")):
        assert word in MESHPLAN_RUNTIME.why_not(ok.replace(**change))


def test_default_search_picks_tiles_the_runtime_runs():
    """One 4096^2 image per step on a DGX H100 node: data parallelism has nothing to split, and the
    runtime-limited search (bf16, tiles without recompute) splits the image over the 8 GPUs."""
    model = resnet.build(depth=20, width=16, image_size=4096)
    g = planner.capture(model, resnet.example_inputs(1, "meta", image_size=4096))
    plan = planner.optimize(g, planner.Cluster.preset("dgx-h100"), global_batch_size=1)
    from planner.capabilities import MESHPLAN_RUNTIME

    assert plan.config.spatial > 1 and plan.prediction.fits
    assert MESHPLAN_RUNTIME.allows(plan.config)


def test_models_without_convolutions_search_the_same_space():
    with torch.device("meta"):
        model = gpt.build(preset="small")
    g = planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset="small"))
    cluster = planner.Cluster.preset("dgx-a100-80gb", nodes=2)
    ev = Evaluator(g, cluster)
    configs = _enumerate(ev, cluster, 32, {}, ("bf16",))
    assert configs and all(c.spatial == 1 for c in configs)
    assert configs == _enumerate(ev, cluster, 32, {"spatial": 1}, ("bf16",))
