"""meshplan's planner: capture a model, cost it, and choose a parallel plan.

The public API is re-exported here: capture, optimize, evaluate, make_plan, explain,
visualize, parallelize, Plan, Cluster, ParallelConfig, Evaluator and the errors they raise on bad
input. Everything else is reached by its module path (planner.graph.ModelGraph,
planner.app.report.write_report, ...); no function here shares its name with a module of this
package (the search is planner.search, the Evaluator's module planner.evaluator, fixed plans
planner.fixed_plan), so every module path works as written. Importing does no work (no device
probing, no measurement, no process groups) and loads none of the application shell
(planner/app/, which reaches codegen): `visualize` and `parallelize` live there and are looked up
on first use (the module-level __getattr__ below).
"""

from cost_models.cluster_file import ClusterFileError
from cost_models.hardware import Cluster
from planner.graph.capture import CaptureError, capture
from planner.config import ConfigError, ParallelConfig
from planner.evaluator import Evaluator, evaluate
from planner.fixed_plan import make_plan
from planner.search import NoFeasiblePlan, explain, optimize
from planner.plan import Plan, PlanFileError
from runtime.lazy import forwarding

# The public names that live in the application shell, by the module that defines them.
_SHELL_NAMES = {"visualize": "planner.app.visualize", "parallelize": "planner.app.parallelize"}


# planner.visualize and planner.parallelize: the shell's functions, imported on first use
__getattr__ = forwarding(_SHELL_NAMES, "planner")


__all__ = [
    "capture", "optimize", "evaluate", "make_plan", "explain", "visualize", "parallelize",
    "Plan", "Cluster", "ParallelConfig", "Evaluator",
    "CaptureError", "ClusterFileError", "ConfigError", "NoFeasiblePlan", "PlanFileError",
]
