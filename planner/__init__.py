"""meshplan's planner: capture a model, cost it, and choose a parallel plan.

Public entry points are re-exported here; importing does no work (no device
probing, no measurement, no process groups).
"""

from cost_models.hardware import Cluster, ClusterFileError, Device, Link
from planner.capture import CaptureError, capture
from planner.config import ConfigError, ParallelConfig
from planner.evaluate import Evaluator, evaluate
from planner.make_plan import make_plan
from planner.optimize import NoFeasiblePlan, explain, optimize
from planner.plan import Plan, PlanFileError, Stage
from cost_models.prediction import Prediction
from planner.graph import Branch, Layer, ModelGraph, OpInfo, TensorMeta
from planner.report import write_report
from planner.visualize import visualize

__all__ = [
    "Branch", "CaptureError", "Cluster", "ClusterFileError", "Device", "Layer", "Link",
    "ModelGraph", "OpInfo", "TensorMeta", "capture",
    "ConfigError", "ParallelConfig", "Evaluator", "evaluate", "Prediction",
    "make_plan", "Plan", "PlanFileError", "Stage", "NoFeasiblePlan", "explain", "optimize",
    "visualize", "write_report",
]

