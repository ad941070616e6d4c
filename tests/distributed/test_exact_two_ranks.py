"""Two real processes over gloo, running the generated rank scripts: after 3 optimizer steps every
rank's loss and every parameter it holds equal the single-process run of the same model, data and
seed (fp32, rtol 1e-4).

All builds run in one pair of worker processes (runtime.launch.worker), each build with its own
rendezvous, so Python and torch start once for the whole matrix.
"""

import pytest

from runtime.launch.launcher import run_many
from tests.parallel_cases import CONFIGS, MODELS, assert_exact, emit_case

MATRIX = [(m, c) for m in MODELS for c in ("d2", "t2", "p2_gpipe", "p2_1f1b", "p2_interleaved")]

# Memory options and training setups, each on the model where it matters most.
FEATURES = {
    "gpt_d2_zero1": ("gpt", dict(data=2, zero=1), {}),
    "resnet_d2_zero2": ("resnet", dict(data=2, zero=2), {}),
    "gpt_d2_zero3": ("gpt", dict(data=2, zero=3), {}),
    "mlp_d2_zero3": ("mlp", dict(data=2, zero=3), {}),
    "gpt_p2_recompute_full": ("gpt", dict(pipeline=2, recompute="full"), {}),
    "gpt_t2_recompute_selective": ("gpt", dict(tensor=2, recompute="selective"), {}),
    "resnet_t2_recompute_full": ("resnet", dict(tensor=2, recompute="full"), {}),
    "mlp_d2_adamw": ("mlp", dict(data=2), {"optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}}),
    "mlp_t2_adamw": ("mlp", dict(tensor=2), {"optimizer": {"name": "adamw", "lr": 0.01}}),
    "gpt_d2_per_module_init": ("gpt", dict(data=2), {"init": "per-module"}),
    "gpt_p2_gpipe_m4": ("gpt", dict(pipeline=2, schedule="gpipe"), {"global_batch": 8, "micro_batch": 1}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_ranks")
    builds = {f"{m}_{c}": emit_case(root, m, c, CONFIGS[c]) for m, c in MATRIX}
    for name, (model, cfg, kw) in FEATURES.items():
        builds[name] = emit_case(root, model, name, cfg, **kw)
    results = run_many(list(builds.values()), steps=3, backend="gloo", timeout=60, verify=True)
    return dict(zip(builds, results))


@pytest.mark.parametrize("model,config", MATRIX)
def test_parallel_run_equals_single_process(runs, model, config):
    assert_exact(runs[f"{model}_{config}"], f"{model} {config}")


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_memory_options_and_optimizers_equal_single_process(runs, name):
    assert_exact(runs[name], name)


def test_every_rank_reports_the_same_loss_each_step(runs):
    for name, res in runs.items():
        per_rank = list(res.losses.values())
        assert all(len(x) == 3 for x in per_rank), name
        assert all(x == per_rank[0] for x in per_rank), f"{name}: ranks disagree on the loss {res.losses}"


def test_data_parallel_overlaps_gradient_all_reduce_with_backward(runs):
    tl = runs["gpt_d2"].timeline
    reduces = [e for e in tl.events if e.op == "ALLREDUCE" and "grads" in e.name]
    assert len(reduces) >= 3 * 2 * 3, "several buckets per step and rank"
    frac = tl.overlap_fraction()
    assert frac is not None and frac > 0.0
    # the buckets are issued from inside the last backward, before its end
    for rank in tl.ranks:
        for step in range(3):
            evs = [e for e in tl.events if e.rank == rank and e.step == step]
            last_b = max((e for e in evs if e.op == "B"), key=lambda e: e.end)
            first = min(e.start for e in evs if e.op == "ALLREDUCE" and "grads" in e.name)
            assert first < last_b.end


def test_ranks_timelines_share_one_clock(runs):
    """No rank sees a collective complete before every member issued it: the ranks' timelines
    are on one clock (runtime.program.trace.shared_origin), not offset by a barrier's exit skew.
    The loss all-reduces are checked: the executor notes their start before it issues them
    (a gradient bucket's is noted by the backward hook after it is issued)."""
    checked = 0
    for name, res in runs.items():
        by_call = {}
        for e in res.timeline.events:
            if e.track == "comm" and e.op == "ALLREDUCE" and " loss " in e.name:
                by_call.setdefault((e.step, e.name), []).append(e)
        for (step, call), evs in by_call.items():
            if len(evs) == len(res.timeline.ranks) > 1:
                checked += 1
                last_issue = max(e.start for e in evs)
                first_done = min(evs, key=lambda e: e.end)
                assert first_done.end >= last_issue, (
                    f"{name} step {step} {call}: rank {first_done.rank} saw it complete at {first_done.end:.6f} s, "
                    f"before the last rank issued it at {last_issue:.6f} s")
    assert checked >= 20, f"only {checked} loss all-reduces over both ranks were traced"
