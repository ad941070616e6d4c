"""meshplan's planner: capture a model, cost it, and choose a parallel plan.

The public API is re-exported here: capture, optimize, evaluate, make_plan, explain,
visualize, parallelize, Plan, Cluster, ParallelConfig, Evaluator and the errors they raise on bad
input. Everything else is reached by its module path (planner.graph.ModelGraph,
planner.app.report.write_report, ...); no function here shares its name with a module of this
package (the search is planner.search, the Evaluator's module planner.evaluator, fixed plans
planner.fixed_plan), so every module path works as written. Importing does no work (no device
probing, no measurement, no process groups).
"""

from cost_models.hardware import Cluster, ClusterFileError
from planner.app.visualize import visualize
from planner.graph.capture import CaptureError, capture
from planner.config import ConfigError, ParallelConfig
from planner.evaluator import Evaluator, evaluate
from planner.fixed_plan import make_plan
from planner.search import NoFeasiblePlan, explain, optimize
from planner.plan import Plan, PlanFileError


def parallelize(model, plan, **kwargs):
    """Apply `plan` to `model` with PyTorch's parallel stack for the user's own training loop:
    planner.app.parallelize.parallelize (imported when called: it reaches codegen's torch layout)."""
    from planner.app.parallelize import parallelize as apply_plan

    return apply_plan(model, plan, **kwargs)


__all__ = [
    "capture", "optimize", "evaluate", "make_plan", "explain", "visualize", "parallelize",
    "Plan", "Cluster", "ParallelConfig", "Evaluator",
    "CaptureError", "ClusterFileError", "ConfigError", "NoFeasiblePlan", "PlanFileError",
]
