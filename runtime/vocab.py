"""The one vocabulary every package shares: mesh axes, shard roles, dtypes, pipeline
schedules, recompute modes, spatial splits, the targets that run a plan and the op kinds of a
captured graph.

They are StrEnums, so a member equals its plain string ("data" == MeshAxis.DATA) and JSON
files keep their spellings; code names the member, never the literal. The runtime owns them
because every package may import runtime and runtime imports none of the others.
"""

from __future__ import annotations

from enum import StrEnum


class MeshAxis(StrEnum):
    """A named axis of the device mesh; its value is the ParallelConfig field giving its degree.

    PIPELINE: pipeline stages (GPipe/1F1B/interleaved, and GEMS bi-directional pipelines).
    SUBGRAPH: sub-grids of one data replica on the same samples (SUPER's sub-graph parallelism).
    CONTEXT: ranks holding chunks of the same sequences (context parallelism: every layer's
    activations split along the sequence; attention exchanges keys and values over it).
    """

    PIPELINE = "pipeline"
    DATA = "data"
    TENSOR = "tensor"
    SPATIAL = "spatial"
    SUBGRAPH = "subgraph"
    CONTEXT = "context"


def default_mesh_order() -> tuple[MeshAxis, ...]:
    """The default order of mesh axes, outermost to innermost: pipeline, data, tensor.

    Tensor is innermost (contiguous ranks) so that a tensor axis that fits in a node
    runs its frequent activation all-reduces on the intra-node link; data comes next;
    pipeline is outermost, since its point-to-point traffic is the lightest (Megatron-LM's
    convention). Other axes (spatial, subgraph, context) sit between data and the innermost
    axis (ParallelConfig.mesh); cost_models/mesh_axes.py works for any axis names.
    """
    return (MeshAxis.PIPELINE, MeshAxis.DATA, MeshAxis.TENSOR)


# mesh axis spellings of Program files written before the axes took the ParallelConfig names
OLD_AXIS_NAMES = {"pipe": MeshAxis.PIPELINE, "branch": MeshAxis.SUBGRAPH}


def current_axis_name(name: str) -> str:
    """A mesh axis name as this build spells it ("pipe" -> "pipeline"); other values unchanged (the
    document checks name a value that is not a string)."""
    return OLD_AXIS_NAMES.get(name, name) if isinstance(name, str) else name


class StrategyName(StrEnum):
    """A parallel strategy: its module name in every package (planner/strategies/, codegen/strategies/,
    runtime/parallel/) and its registry key. BIDIRECTIONAL is GEMS/MASTER; SUBGRAPH is SUPER."""

    DATA = "data"
    TENSOR = "tensor"
    PIPELINE = "pipeline"
    BIDIRECTIONAL = "bidirectional"
    SPATIAL = "spatial"
    SUBGRAPH = "subgraph"
    CONTEXT = "context"


class Target(StrEnum):
    """What carries a plan out.

    MESHPLAN: meshplan's own runtime (codegen's per-rank Programs over gloo, NCCL or MPI).
    TORCH: PyTorch's parallel stack (DeviceMesh, DTensor tensor/sequence parallelism, FSDP2,
    torch.distributed.pipelining, Distributed Checkpoint) through planner.parallelize or the
    generated torch script; planner/capabilities.py says which strategies each runs.
    """

    MESHPLAN = "meshplan"
    TORCH = "torch"


class ShardRole(StrEnum):
    """How tensor parallelism splits one op (Megatron's column/row parallel layers).

    COLUMN: output features split; COLUMN_OUT: the last projection, logits left split on the
    vocabulary (vocabulary-parallel loss); ROW: input features split, output all-reduced;
    INNER: an op between column and row that keeps the split; VOCAB: an embedding table split by
    rows; CHANNELS: a per-channel norm between column and row keeps its channels; SEQUENCE: a module
    kept whole that runs on this rank's block of the sequence (sequence parallelism), whose
    parameters' gradients are all-reduced over the tensor axis; REPLICATE: not split, every tensor
    rank runs the op whole (the role of every node a plan does not list). SPLIT_ROLES below are the
    roles a plan's tensor split may store.
    """

    REPLICATE = "replicate"
    COLUMN = "column"
    COLUMN_OUT = "column_out"
    ROW = "row"
    INNER = "inner"
    VOCAB = "vocab"
    CHANNELS = "channels"
    SEQUENCE = "sequence"

    @property
    def splits_output(self) -> bool:
        """Whether the op's output features are split (a column layer, the last one included)."""
        return self in (ShardRole.COLUMN, ShardRole.COLUMN_OUT)


# the roles that split something (a module's or weight op's shard in a plan's tensor split)
SPLIT_ROLES = tuple(r for r in ShardRole if r != ShardRole.REPLICATE)


class Collective(StrEnum):
    """A collective operation (or a point-to-point transfer) as the cost model prices it and the
    communicators name it: cost_models/comm.py collective_time's `op`, runtime/comm's failures."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"


class Backend(StrEnum):
    """How a build's ranks talk: torch.distributed over gloo (CPU tensors) or NCCL (CUDA tensors), or
    MPI through mpi4py (runtime/comm/mpi.py)."""

    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"


class DeviceKind(StrEnum):
    """What one rank runs on (cost_models.hardware.Device.kind): a GPU, priced kernel by kernel with its
    own constants (cost_models/gpu_costs.py), or a CPU process, priced from its measured figures. Cluster
    files hold the value."""

    GPU = "gpu"
    CPU = "cpu"


class OpKind(StrEnum):
    """What a captured fx node does, as the cost models price it (OpInfo.kind). planner/graph/ops.py
    classify gives every node one, from its leaf module's class or its function's base name, so that no
    cost model needs to know which capture path (fx or torch.export) made the node; captured graph
    files hold the value.

    INPUT: a placeholder (the model's inputs); OUTPUT: the graph's output node; PARAM: a get_attr
    (a parameter or buffer); SCALAR: a call that returns no tensor (sizes, Python numbers).
    LINEAR: x W^T with a weight (nn.Linear, F.linear, addmm, a matmul by a parameter); MATMUL: a
    product of two activations (bmm, einsum, ...); CONV: a convolution; ATTENTION: scaled dot-product
    attention, fused or as nn.MultiheadAttention; EMBEDDING: a table look-up; NORM: batch, layer,
    group and RMS norms; SOFTMAX: softmax and log-softmax; POOL: max and average pools; CONCAT: cat and
    stack; LOSS: a loss function; VIEW: views and metadata ops (reshape, transpose, getitem, casts,
    contiguous: no arithmetic, at most a copy); ELEMENTWISE: everything else that returns a tensor
    (activations, arithmetic, dropout), priced as memory-bound.
    """

    INPUT = "input"
    OUTPUT = "output"
    PARAM = "param"
    SCALAR = "scalar"
    LINEAR = "linear"
    MATMUL = "matmul"
    CONV = "conv"
    ATTENTION = "attention"
    EMBEDDING = "embedding"
    NORM = "norm"
    SOFTMAX = "softmax"
    POOL = "pool"
    CONCAT = "concat"
    LOSS = "loss"
    VIEW = "view"
    ELEMENTWISE = "elementwise"


class DType(StrEnum):
    """A compute dtype (ParallelConfig.dtype): fp32, or mixed precision with fp32 master weights."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def bytes(self) -> int:
        """Bytes per element."""
        return 4 if self is DType.FP32 else 2

    @property
    def torch_name(self) -> str:
        """The torch dtype's name ("float32", "bfloat16", "float16")."""
        return {DType.FP32: "float32", DType.BF16: "bfloat16", DType.FP16: "float16"}[self]


# bytes per element of every torch dtype a captured graph may hold, by torch's name
ELEMENT_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


def element_bytes(torch_dtype: str) -> int:
    """Bytes per element of a torch dtype named "float32" or "torch.float32"; ValueError if unknown."""
    name = str(torch_dtype).removeprefix("torch.")
    try:
        return ELEMENT_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown tensor dtype {torch_dtype!r}; known: {', '.join(ELEMENT_BYTES)}") from None


class Schedule(StrEnum):
    """A one-directional pipeline schedule (the bi-directional GEMS one is ParallelConfig.bidirectional)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


class RecomputeMode(StrEnum):
    """Activation recomputation: none, selective (attention's softmax and the like), full (whole stage)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class SpatialSplit(StrEnum):
    """How spatial parallelism tiles an image: s horizontal strips, s vertical strips, or a rows x cols grid."""

    STRIPS_H = "strips_h"
    STRIPS_V = "strips_v"
    GRID = "grid"


class ContextAttention(StrEnum):
    """How attention reaches the keys and values of the other context-parallel ranks.

    RING: key/value blocks pass around the ring (ring attention), each rank holding two
    sequence chunks in the causal load-balanced order; ULYSSES: an all-to-all turns the
    sequence split into a head split for attention and back (DeepSpeed-Ulysses)."""

    RING = "ring"
    ULYSSES = "ulysses"


class SpatialBatchNorm(StrEnum):
    """BatchNorm statistics under spatial parallelism: over the whole image (exact) or per tile."""

    SYNC = "sync"
    LOCAL = "local"


class Track(StrEnum):
    """Where a Timeline event sits (runtime/program/trace.py).

    COMPUTE: a blocking instruction; COMM: an asynchronous one, from its issue to its completion.
    Both are on the clock the run was timed with: the host's perf_counter on CPUs, CUDA events on
    the device on a GPU. HOST and HOST_COMM: the same instructions as the host ran them (its
    perf_counter), recorded beside the device ones on a GPU only."""

    COMPUTE = "compute"
    COMM = "comm"
    HOST = "host"
    HOST_COMM = "host_comm"


class Clock(StrEnum):
    """What timed a Timeline's COMPUTE and COMM events: the host's perf_counter around each
    instruction (HOST), or CUDA events on the device's streams (CUDA; the host's intervals are
    then on the HOST tracks)."""

    HOST = "host"
    CUDA = "cuda"
