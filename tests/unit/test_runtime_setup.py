"""runtime data slicing, specs, initialisation and the single-process reference."""

import pytest
import torch

from examples.models import gpt, mlp
from runtime.data import DataError, DataSource
from runtime.materialize import build_model, build_stage, model_signature
from runtime.execute.optim import OptimizerSpec
from runtime.parallel.registry import StageSplits
from runtime.reference import reference_run
from runtime.spec import SpecError, StageSpec, TrainSpec
from tests.parallel_cases import graph_of, plan_for


def test_each_data_rank_reads_its_rows_in_micro_batches():
    src = [DataSource(mlp.example_batch, {}, 8, 2, r, 2, data_seed=5) for r in range(2)]
    (x,), y = mlp.example_batch(8, 5)
    chunks = [c for s in src for c in s.micro_batches(0)]
    assert len(chunks) == 4
    assert torch.equal(torch.cat([c[0][0] for c in chunks]), x) and torch.equal(torch.cat([c[1] for c in chunks]), y)


def test_a_factory_that_takes_start_and_stop_is_asked_for_the_slice_only():
    calls = []

    def data(batch_size, seed, start=0, stop=None):
        calls.append((batch_size, seed, start, stop))
        rows = torch.arange(start, stop).float().unsqueeze(1)
        return (rows,), rows.squeeze(1).long()

    (x,), _ = DataSource(data, {}, 8, 2, 1, 2, data_seed=0).local_batch(3)
    assert calls == [(8, 3, 4, 8)] and x.squeeze(1).tolist() == [4, 5, 6, 7]
    with pytest.raises(DataError, match="does not split"):
        DataSource(data, {}, 6, 4, 0, 1)


def test_specs_round_trip_and_validate(tmp_path):
    spec = TrainSpec("examples/models/mlp.py:build", "examples/models/mlp.py:example_batch", 8,
                     optimizer=OptimizerSpec("adamw", lr=1e-3), init="per-module")
    spec.save(tmp_path / "b.json")
    assert TrainSpec.load(tmp_path / "b.json") == spec
    with pytest.raises(SpecError, match="init"):
        spec.replace(init="random")
    with pytest.raises(ValueError, match="optimizer"):
        OptimizerSpec("lamb")
    from codegen.partition import partition

    parts = partition(plan_for("gpt", tensor=2, pipeline=2), graph_of("gpt"))
    for p in parts.stages:
        assert StageSpec.from_dict(p.spec.to_dict()) == p.spec


def test_per_module_and_checkpoint_initialisation_are_reproducible(tmp_path):
    base = TrainSpec("examples/models/gpt.py:build", "examples/models/gpt.py:example_batch", 4, init="per-module")
    a, b = build_model(base), build_model(base)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    torch.save(a.state_dict(), tmp_path / "ck.pt")
    c = build_model(base.replace(init="checkpoint", checkpoint=str(tmp_path / "ck.pt")))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert model_signature(a) == model_signature(c)


def test_a_stage_built_from_a_checkpoint_holds_its_slice(tmp_path):
    from codegen.partition import partition, stage_imports

    parts = partition(plan_for("gpt", tensor=2, pipeline=2), graph_of("gpt"))
    torch.manual_seed(3)
    model = gpt.build()
    torch.save(model.state_dict(), tmp_path / "ck.pt")
    spec = TrainSpec("examples/models/gpt.py:build", "examples/models/gpt.py:example_batch", 4,
                     init="checkpoint", checkpoint=str(tmp_path / "ck.pt"))
    ns: dict = {}
    exec("\n".join(stage_imports([parts.stages[1]])) + "\n" + parts.stages[1].source, ns)
    stage = build_stage(ns["Stage1"], parts.stages[1].spec, spec, tensor_rank=1, tensor_size=2, splits=StageSplits())
    w = dict(stage.named_parameters())["lm_head.weight"]
    assert torch.equal(w, model.lm_head.weight[64:])
    assert "wte.weight" not in dict(stage.named_parameters())     # only this stage's parameters


def test_reference_in_micro_batch_chunks_equals_the_plain_full_batch_step():
    spec = TrainSpec("examples/models/gpt.py:build", "examples/models/gpt.py:example_batch", 8,
                     optimizer=OptimizerSpec("sgd", lr=0.1, momentum=0.9))
    chunked, full = reference_run(spec, 3, micro_batch_size=2), reference_run(spec, 3)
    assert chunked.losses == pytest.approx(full.losses, rel=1e-6)
    for k, v in full.params.items():
        torch.testing.assert_close(chunked.params[k], v, rtol=1e-5, atol=1e-7)
