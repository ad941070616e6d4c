"""meshplan's planner: capture a model, cost it, and choose a parallel plan.

The public API is re-exported here: capture, optimize, evaluate, make_plan, explain,
visualize, parallelize, Plan, Cluster, ParallelConfig and the errors they raise on bad input. Everything
else is reached by its module path (planner.graph.ModelGraph, planner.evaluate.Evaluator,
planner.app.report.write_report, ...). Importing does no work (no device probing, no
measurement, no process groups).
"""

from cost_models.hardware import Cluster, ClusterFileError
from planner.app.visualize import visualize
from planner.graph.capture import CaptureError, capture
from planner.config import ConfigError, ParallelConfig
from planner.evaluate import evaluate
from planner.make_plan import make_plan
from planner.optimize import NoFeasiblePlan, explain, optimize
from planner.plan import Plan, PlanFileError



def parallelize(model, plan, **kwargs):
    """Apply `plan` to `model` with PyTorch's parallel stack for the user's own training loop:
    planner.app.parallelize.parallelize (imported when called: it reaches codegen's torch layout)."""
    from planner.app.parallelize import parallelize as apply_plan

    return apply_plan(model, plan, **kwargs)


__all__ = [
    "capture", "optimize", "evaluate", "make_plan", "explain", "visualize", "parallelize",
    "Plan", "Cluster", "ParallelConfig",
    "CaptureError", "ClusterFileError", "ConfigError", "NoFeasiblePlan", "PlanFileError",
]
