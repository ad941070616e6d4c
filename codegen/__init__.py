"""Code generation: lowers a Plan into one Program per rank and emits readable rank
scripts plus launchers (torchrun, mpirun, srun).

    codegen.partition(plan, graph) -> Partition      per-stage modules, tensor-parallel splits
    codegen.lower(plan, graph)     -> {rank: Program}
    codegen.emit(plan, model_ref, data_ref, out_dir) writes the build directory
"""

from codegen.emit import Build, PlanMismatchError, emit
from codegen.lower import DEFAULT_BUCKET_BYTES, LoweringError, check_programs, lower
from codegen.partition import Partition, PartitionError, StagePart, partition
from runtime.schedules import ScheduleError, build_schedule
from codegen.tensor_split import TensorSplitError

__all__ = ["Build", "DEFAULT_BUCKET_BYTES", "LoweringError", "PlanMismatchError", "emit", "Partition", "PartitionError", "ScheduleError", "StagePart",
           "TensorSplitError", "build_schedule", "check_programs", "lower", "partition"]
