"""The torch layout's choices as enums, shared by the layout (codegen/torch_target/layout.py) and the
code that applies it here; the values are the names a layout's JSON holds."""

from __future__ import annotations

from enum import StrEnum


class TensorStyle(StrEnum):
    """How one module is split over the tensor axis.

    COLWISE: torch's ColwiseParallel, output features in contiguous blocks.
    COLWISE_STRIDED: output features in `groups` equal parts each split in contiguous blocks (a fused qkv:
        rank r holds q_r, k_r, v_r), the weight a DTensor with _StridedShard(0, split_factor=groups).
    OUTPUT_COLWISE: the last projection split on the vocabulary, its logits gathered whole.
    ROWWISE: torch's RowwiseParallel, input features split, output all-reduced.
    EMBEDDING_ROWWISE: RowwiseParallel on nn.Embedding, the table's rows split by vocabulary.
    SEQUENCE: torch's SequenceParallel, a module kept whole on this rank's block of the sequence.
    SEQUENCE_SCATTER: a replicated module whose output is cut to this rank's block of the sequence.
    SEQUENCE_GATHER: a replicated module that reads a sequence-split input whole.
    """

    COLWISE = "colwise"
    COLWISE_STRIDED = "colwise_strided"
    OUTPUT_COLWISE = "output_colwise"
    ROWWISE = "rowwise"
    EMBEDDING_ROWWISE = "embedding_rowwise"
    SEQUENCE = "sequence"
    SEQUENCE_SCATTER = "sequence_scatter"
    SEQUENCE_GATHER = "sequence_gather"


class DataKind(StrEnum):
    """What wraps the model over the data axis: nothing (data degree 1), replicate, or fully_shard."""

    NONE = "none"
    REPLICATE = "replicate"
    FULLY_SHARD = "fully_shard"
