"""`meshplan codegen` flags that name a torch Dataset instead of a batch factory (runtime/datasets.py).

    meshplan codegen examples/models/gpt.py:build --arg preset=tiny --arg vocab_size=256 --batch 8 \\
        --dataset examples/data/tokens.py:TokenFile --dataset-arg path=corpus.bin --dataset-arg seq_len=16 \\
        --holdout 0.1 -o build
"""

from __future__ import annotations

import argparse

import torch

from runtime.data import DataError, Split
from runtime.datasets import DatasetSpec, LastBatch, open_dataset
from runtime.vocab import OpKind

# flags that mean nothing without --dataset: (attribute, flag, its default)
_DATASET_ONLY = (("collate", "--collate", None), ("no_shuffle", "--no-shuffle", False),
                 ("last_batch", "--last-batch", LastBatch.DROP.value), ("holdout", "--holdout", 0.0),
                 ("eval_dataset_arg", "--eval-dataset-arg", []), ("data_workers", "--data-workers", 0),
                 ("dataset_arg", "--dataset-arg", []))


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in [0, 1)")
    return value


def _workers(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(text)


def add_dataset_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset (instead of --data-ref; runtime/datasets.py)")
    g.add_argument("--dataset", metavar="REF", help="a torch Dataset class, or a function returning one "
                   "(e.g. examples/data/tokens.py:TokenFile)")
    g.add_argument("--dataset-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="dataset keyword (repeatable)")
    g.add_argument("--collate", metavar="REF", help="collate function fn(samples) -> (inputs, targets) "
                   "(default: torch's default_collate)")
    g.add_argument("--no-shuffle", action="store_true", help="read every epoch in index order")
    g.add_argument("--last-batch", choices=[m.value for m in LastBatch], default=LastBatch.DROP.value,
                   help="an epoch's partial last global batch: skip it (drop) or fill it from the epoch's start")
    g.add_argument("--holdout", type=_fraction, default=0.0, help="fraction of the dataset (its tail) held "
                   "out of training for evaluation")
    g.add_argument("--eval-dataset-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword of a separate evaluation dataset, built like the training one with these "
                   "arguments instead (repeatable; e.g. path=val.bin)")
    g.add_argument("--data-workers", type=_workers, default=0, help="DataLoader worker processes per rank")


def dataset_spec(args: argparse.Namespace) -> DatasetSpec | None:
    """The DatasetSpec the flags describe (args.dataset_kwargs / args.eval_dataset_kwargs: the parsed
    KEY=VALUE lists), or None without --dataset; ValueError for flags that contradict each other."""
    if getattr(args, "dataset", None) is None:
        given = [flag for attr, flag, default in _DATASET_ONLY if getattr(args, attr, default) != default]
        if given:
            raise ValueError(f"{', '.join(given)} describe a dataset: give --dataset REF too")
        return None
    if args.data_ref or args.data_arg:
        raise ValueError("--dataset replaces the batch factory: drop --data-ref/--data-arg (use --dataset-arg)")
    return DatasetSpec(ref=args.dataset, kwargs=args.dataset_kwargs, collate_ref=args.collate,
                       shuffle=not args.no_shuffle, last_batch=LastBatch(args.last_batch), holdout=args.holdout,
                       eval_kwargs=args.eval_dataset_kwargs, workers=args.data_workers)


def check_dataset(spec: DatasetSpec, global_batch_size: int, graph=None) -> None:
    """Build the dataset (and its evaluation split, when it has one) and read one sample of each, so
    that a wrong reference, argument or sample form fails here, not on every rank; with the captured
    `graph` (planner.graph.ModelGraph), also that sample against the model (`check_sample`)."""
    splits = [Split.TRAIN] + ([Split.EVAL] if spec.holdout > 0 or spec.eval_kwargs is not None else [])
    for split in splits:
        # data rank 0 of G with micro-batches of 1 reads exactly one sample
        batch = open_dataset(spec, global_batch_size, 1, 0, global_batch_size, split=split).micro_batches(0)[0]
        if graph is not None:
            check_sample(batch, graph, f"--dataset {spec.ref}" + (" (its evaluation split)" if split == Split.EVAL
                                                                  else ""))


def _integer(t) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.numel() > 0 \
        and t.dtype != torch.bool


def check_sample(batch, graph, what: str) -> None:
    """DataError when a sample (inputs, targets) cannot go through the captured model: a token id beyond
    the vocabulary of the embedding that reads it, a sequence longer than a position embedding's table
    (an embedding indexed by arange over the sequence), or a class id beyond the model's outputs."""
    inputs, targets = batch
    nodes = {n.name: n for n in graph.nodes}
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    if isinstance(inputs, dict):   # keyword inputs: by the model's argument names
        inputs = tuple(inputs.get(name) for name in placeholders)
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    for node in graph.nodes:
        if node.kind != OpKind.EMBEDDING or not node.inputs:
            continue
        rows = dict(node.attrs).get("num_embeddings")
        src = nodes.get(node.inputs[0])
        if rows is None or src is None:
            continue
        if src.op == "placeholder" and src.name in placeholders:
            i = placeholders.index(src.name)
            if i < len(inputs) and _integer(inputs[i]) and int(inputs[i].max()) >= rows:
                raise DataError(f"{what}: a sample holds token id {int(inputs[i].max())}, but the model's embedding "
                                f"{node.module_path or node.name} has {rows} rows (ids 0..{rows - 1}); give the model a "
                                "larger vocabulary (its --arg) or the dataset a smaller one")
        elif "arange" in src.target and inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() >= 2:
            length = int(inputs[0].shape[-1])
            if length > rows:
                raise DataError(f"{what}: samples are {length} tokens long, but the model's position embedding "
                                f"{node.module_path or node.name} covers {rows} positions; give the model more "
                                "positions (its --arg) or the dataset shorter samples (its --dataset-arg)")
    out = next((n for n in graph.nodes if n.op == "output"), None)
    classes = out.input_meta[0].shape[-1] if out is not None and out.input_meta and out.input_meta[0].shape else None
    if classes and _integer(targets) and int(targets.max()) >= classes:
        raise DataError(f"{what}: a sample's target is class {int(targets.max())}, but the model gives {classes} "
                        "outputs per position; give the model more outputs or the dataset fewer classes")
