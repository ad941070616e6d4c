"""Datasets by reference (runtime/datasets.py): which samples every data rank reads, step by step,
epoch by epoch and after a resume; evaluation splits; sample checks; the token-file dataset and the
byte-level tokenizer (examples/data)."""

import json

import numpy as np
import pytest
import torch

from examples.data import tokenize_text
from examples.data.tokens import TokenFile, TokenFileError, read_meta, sidecar, write_tokens
from planner.app.cli import main
from runtime.data import DataError, Split
from runtime.datasets import (DatasetSource, DatasetSpec, EpochOrder, LastBatch, RankStream, open_dataset)
from runtime.refs import RefError
from runtime.spec import TrainSpec
from tests.dataset_cases import IndexStream

IDX = "tests/dataset_cases.py:IndexDataset"


def ids(batches) -> list[int]:
    """The dataset indices a list of micro-batches read (IndexDataset: targets are the indices)."""
    return [int(v) for _, t in batches for v in t]


def source(n=40, g=8, mb=2, rank=0, size=1, seed=7, **spec_kw) -> DatasetSource:
    spec = DatasetSpec(IDX, {"n": n}, **spec_kw)
    return open_dataset(spec, g, mb, rank, size, seed)


def test_ranks_read_disjoint_rows_that_cover_the_global_batch_in_the_reference_order():
    ranks = [source(rank=r, size=2) for r in range(2)]
    ref = source(mb=2)   # the single-process reference: data rank 0 of 1
    for step in range(7):   # 40 // 8 = 5 steps per epoch: crosses into epoch 1
        parts = [ids(s.micro_batches(step)) for s in ranks]
        assert all(len(p) == 4 for p in parts)
        assert not set(parts[0]) & set(parts[1])
        assert parts[0] + parts[1] == ids(ref.micro_batches(step))
        (x,), y = ref.global_batch(step)
        assert x.shape == (8, 1) and y.tolist() == parts[0] + parts[1]


def test_a_rank_fetches_only_its_own_samples():
    s = source(rank=1, size=2)
    s.micro_batches(0)
    whole = ids(source().micro_batches(0))
    assert sorted(s.dataset.read) == sorted(whole[4:])


def test_each_epoch_is_a_deterministic_permutation_reshuffled_per_epoch():
    a, b = source(n=24), source(n=24)   # G 8: 3 steps per epoch, nothing dropped
    epochs = [[i for s in range(3 * e, 3 * e + 3) for i in ids(a.micro_batches(s))] for e in range(3)]
    assert all(sorted(e) == list(range(24)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[1] == [i for s in range(3, 6) for i in ids(b.micro_batches(s))]
    expected = torch.randperm(24, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    assert epochs[1] == expected   # epoch e: torch.randperm seeded with data_seed + e
    assert [i for s in range(3) for i in ids(source(n=24, seed=8).micro_batches(s))] == epochs[1]


def test_no_shuffle_reads_in_index_order():
    s = source(n=20, shuffle=False)
    assert [ids(s.micro_batches(k)) for k in range(3)] == [list(range(8)), list(range(8, 16)), list(range(8))]


def test_drop_and_pad_give_their_steps_per_epoch():
    assert EpochOrder(20, 8, 0, last_batch=LastBatch.DROP).steps_per_epoch == 2
    assert EpochOrder(20, 8, 0, last_batch=LastBatch.PAD).steps_per_epoch == 3
    drop = source(n=20, last_batch=LastBatch.DROP)
    order = drop.order
    perm0 = order.permutation(0).tolist()
    assert ids(drop.micro_batches(1)) == perm0[8:16]
    assert ids(drop.micro_batches(2)) == order.permutation(1).tolist()[:8]   # the tail of epoch 0 skipped
    pad = source(n=20, last_batch=LastBatch.PAD)
    assert ids(pad.micro_batches(2)) == perm0[16:20] + perm0[:4]   # filled from the epoch's start
    assert ids(pad.micro_batches(3)) == pad.order.permutation(1).tolist()[:8]
    assert pad.epoch_of(2) == 0 and pad.epoch_of(3) == 1


def test_resume_mid_epoch_reads_the_next_samples_by_arithmetic():
    walked = source(n=44, rank=1, size=2)   # 5 steps per epoch, 4 samples dropped each epoch
    seq = [walked.micro_batches(s) for s in range(12)]
    for start in (3, 7, 10):
        fresh = source(n=44, rank=1, size=2)
        assert [ids(fresh.micro_batches(s)) for s in range(start, 12)] == [ids(b) for b in seq[start:]]
    assert [walked.epoch_of(s) for s in (0, 4, 5, 9, 10)] == [0, 0, 1, 1, 2]
    assert walked.order.position(7) == (1, 16)


def test_held_out_tail_is_never_trained_on_and_is_the_eval_split():
    train = source(n=40, holdout=0.25)   # 30 training samples, 10 held out
    seen = {i for s in range(12) for i in ids(train.micro_batches(s))}
    assert seen <= set(range(30))
    ev = [open_dataset(DatasetSpec(IDX, {"n": 40}, holdout=0.25), 8, 2, r, 2, 7, Split.EVAL) for r in range(2)]
    assert ids(ev[0].micro_batches(0)) + ids(ev[1].micro_batches(0)) == list(range(30, 38))
    assert ids(ev[0].micro_batches(1)) + ids(ev[1].micro_batches(1)) == [38, 39] + list(range(30, 36))   # wraps


def test_eval_kwargs_build_a_separate_eval_dataset():
    spec = DatasetSpec("tests/dataset_cases.py:index_dataset", {"n": 40}, eval_kwargs={"n": 6, "split": "val"})
    ev = open_dataset(spec, 4, 2, 0, 1, split=Split.EVAL)
    assert ids(ev.micro_batches(1)) == [1004, 1005, 1000, 1001]
    with pytest.raises(DataError, match="no evaluation split.*--holdout"):
        open_dataset(DatasetSpec(IDX, {"n": 40}), 8, 2, split=Split.EVAL)


def test_iterable_streams_group_global_batches_and_skip_on_resume():
    spec = DatasetSpec("tests/dataset_cases.py:IndexStream", {"n": 10})
    ranks = [open_dataset(spec, 4, 1, r, 2) for r in range(2)]
    steps = [[ids(s.micro_batches(k)) for s in ranks] for k in range(5)]
    # epochs of 10 read back to back: step 2 is samples 8, 9 of epoch 0 and 0, 1 of epoch 1
    assert steps[2] == [[8, 9], [100, 101]]
    assert steps[0] == [[0, 1], [2, 3]] and steps[4] == [[106, 107], [108, 109]]
    assert ranks[0].dataset.epochs_set == [0, 1]
    assert [ranks[0].epoch_of(k) for k in (0, 2, 3)] == [0, 0, 1]
    resumed = open_dataset(spec, 4, 1, 1, 2)
    assert [ids(resumed.micro_batches(k)) for k in (3, 4)] == [steps[3][1], steps[4][1]]


def test_rank_stream_keeps_only_its_rows():
    stream = RankStream(IndexStream(6), 3, 1, 2, start_step=1, name="s")
    it = iter(stream)
    assert [int(next(it)[1]) for _ in range(3)] == [4, 101, 104]


def test_iterables_refuse_what_they_cannot_do():
    for kw, text in (({"workers": 2}, "--data-workers 0"), ({"holdout": 0.1}, "--eval-dataset-arg"),
                     ({"last_batch": LastBatch.PAD}, "--last-batch")):
        with pytest.raises(DataError, match=text):
            open_dataset(DatasetSpec("tests/dataset_cases.py:IndexStream", {"n": 10}, **kw), 4, 1)


def test_a_sample_of_another_form_is_a_data_error_naming_the_dataset():
    s = open_dataset(DatasetSpec("tests/dataset_cases.py:TensorOnly"), 4, 2)
    with pytest.raises(DataError, match=r"dataset tests/dataset_cases.py:TensorOnly returned a sample of type "
                                        r"Tensor.*\(inputs, target\)"):
        s.micro_batches(0)


def test_dict_inputs_and_a_collate_function_with_keywords():
    d = open_dataset(DatasetSpec("tests/dataset_cases.py:DictDataset", shuffle=False), 4, 2)
    inputs, y = d.micro_batches(0)[1]
    assert isinstance(inputs, dict) and inputs["input_ids"].tolist() == [[2, 2], [3, 3]] and y.tolist() == [2, 3]
    c = open_dataset(DatasetSpec(IDX, {"n": 8}, collate_ref="tests/dataset_cases.py:pair_collate",
                                 collate_kwargs={"scale": 2.0}, shuffle=False), 4, 2)
    (x,), y = c.micro_batches(0)[1]
    assert x.flatten().tolist() == [4.0, 6.0] and y.tolist() == [2, 3]


def test_bad_references_and_sizes_name_the_dataset():
    with pytest.raises(RefError, match="dataset 'tests/dataset_cases.py:Nope'"):
        open_dataset(DatasetSpec("tests/dataset_cases.py:Nope"), 4, 2)
    with pytest.raises(RefError, match="dataset tests/dataset_cases.py:IndexDataset.*accepts n, offset"):
        open_dataset(DatasetSpec(IDX, {"size": 3}), 4, 2)
    with pytest.raises(DataError, match="3 training samples, fewer than the global batch of 4.*pad"):
        open_dataset(DatasetSpec(IDX, {"n": 3}), 4, 2)
    assert ids(open_dataset(DatasetSpec(IDX, {"n": 3}, last_batch=LastBatch.PAD, shuffle=False), 4, 2)
               .micro_batches(0)) == [0, 1, 2, 0]
    with pytest.raises(DataError, match="holds out 0"):
        open_dataset(DatasetSpec(IDX, {"n": 8}, holdout=0.05), 4, 2)
    with pytest.raises(DataError, match="not both"):
        DatasetSpec(IDX, holdout=0.1, eval_kwargs={"n": 2})


def test_dataset_spec_round_trips_through_the_build_file():
    spec = DatasetSpec(IDX, {"n": 4}, collate_ref="a.py:c", collate_kwargs={"k": 1}, shuffle=False,
                       last_batch=LastBatch.PAD, eval_kwargs={"split": "val"}, workers=2)
    train = TrainSpec(model_ref="m.py:build", data_ref="", global_batch_size=8, dataset=spec)
    back = TrainSpec.from_dict(json.loads(json.dumps(train.to_dict())))
    assert back == train and back.dataset.last_batch is LastBatch.PAD
    with pytest.raises(DataError, match="last_batch 'tail'"):
        TrainSpec.from_dict({**train.to_dict(), "dataset": {**spec.to_dict(), "last_batch": "tail"}})


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_round_trip(tmp_path, dtype):
    tokens = np.arange(0, 70001, 1000) if dtype == "uint32" else np.arange(0, 50)
    path = write_tokens(tmp_path / "t.bin", tokens, dtype)
    assert read_meta(path)["dtype"] == dtype and path.stat().st_size == len(tokens) * np.dtype(dtype).itemsize
    ds = TokenFile(str(path), seq_len=8)
    assert len(ds) == (len(tokens) - 1) // 8
    x, y = ds[1]
    assert x.dtype == torch.int64 and x.tolist() == tokens[8:16].tolist() and y.tolist() == tokens[9:17].tolist()


def test_token_file_errors(tmp_path):
    with pytest.raises(TokenFileError, match="outside uint16.*uint32"):
        write_tokens(tmp_path / "big.bin", [70000], "uint16")
    path = write_tokens(tmp_path / "t.bin", list(range(20)))
    sidecar(path).unlink()
    with pytest.raises(TokenFileError, match="no sidecar"):
        TokenFile(str(path), 4)
    with pytest.raises(TokenFileError, match="does not exist"):
        TokenFile(str(tmp_path / "missing.bin"), 4)


def test_tokenize_script_writes_byte_level_train_and_val_files(tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_text("hello, token files\n" * 10)
    out = tmp_path / "sub" / "corpus.bin"
    assert tokenize_text.main([str(text), "-o", str(out), "--val-fraction", "0.1"]) == 0
    data = text.read_bytes()
    val = tmp_path / "sub" / "corpus.val.bin"
    assert "wrote" in capsys.readouterr().out
    assert np.fromfile(out, np.uint16).tobytes() == np.frombuffer(data[:171], np.uint8).astype(np.uint16).tobytes()
    assert bytes(np.fromfile(val, np.uint16).astype(np.uint8)) == data[171:]
    assert read_meta(val) == {"dtype": "uint16", "num_tokens": 19, "vocab_size": 256}
    assert tokenize_text.main([str(tmp_path / "none.txt"), "-o", str(out)]) == 2


def test_codegen_dataset_flags_need_dataset_and_exclude_the_factory(tmp_path, capsys):
    base = ["codegen", "examples/models/mlp.py:build", "--batch", "8", "-o", str(tmp_path / "b")]
    assert main(base + ["--holdout", "0.1"]) == 2
    assert "--holdout describe a dataset: give --dataset REF" in capsys.readouterr().err
    assert main(base + ["--dataset", IDX, "--data-ref", "examples/models/mlp.py:example_batch"]) == 2
    assert "--dataset replaces the batch factory" in capsys.readouterr().err
    assert main(base + ["--dataset", "tests/dataset_cases.py:TensorOnly"]) == 2
    assert "returned a sample of type Tensor" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("kwargs", [1]), ("eval_kwargs", "val"), ("shuffle", "yes"),
                                          ("collate_ref", 3), ("workers", -1), ("holdout", 1.0)])
def test_a_damaged_dataset_entry_in_the_build_file_is_refused(field, value):
    with pytest.raises(DataError, match=field.replace("_ref", "")):
        DatasetSpec.from_dict({"ref": IDX, field: value})
