"""Eight real processes over gloo (data 2 x tensor 2 x pipeline 2) equal the single-process run."""

import pytest

from runtime.launch.launcher import run_many
from tests.parallel_cases import CONFIGS, MODELS, assert_exact, emit_case

pytestmark = pytest.mark.slow

COMBOS = {
    "gpt_d2t2p2_interleaved_zero1_full": ("gpt", dict(data=2, tensor=2, pipeline=2, schedule="interleaved",
                                                     virtual_stages=2, zero=1, recompute="full")),
    "resnet_d2t2p2_gpipe_zero3": ("resnet", dict(data=2, tensor=2, pipeline=2, schedule="gpipe", zero=3)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eight_ranks")
    builds = {m: emit_case(root, m, "d2t2p2", CONFIGS["d2t2p2"]) for m in MODELS}
    for name, (model, cfg) in COMBOS.items():
        builds[name] = emit_case(root, model, name, cfg)
    results = run_many(list(builds.values()), steps=3, backend="gloo", timeout=90, verify=True)
    return dict(zip(builds, results))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_data_tensor_pipeline_on_eight_ranks(runs, model):
    assert_exact(runs[model], f"{model} d2 t2 p2")
    assert runs[model].world_size == 8


@pytest.mark.parametrize("name", sorted(COMBOS))
def test_combined_schedules_and_memory_options(runs, name):
    assert_exact(runs[name], name)
