"""Code generation: lowers a Plan into one Program per rank and emits readable rank
scripts plus launchers (torchrun, mpirun, srun).

    codegen.partition(plan, graph) -> Partition      per-stage modules, tensor-parallel splits
    codegen.lower(plan, graph)     -> {rank: Program}
    codegen.emit(plan, model_ref, data_ref, out_dir) -> Build   writes the build directory

Everything else is reached by its module path (runtime.program.schedules.build_schedule, ...).
"""

from codegen.emit import Build, emit
from codegen.lower import LoweringError, lower
from codegen.partition import partition

__all__ = ["Build", "LoweringError", "emit", "lower", "partition"]
