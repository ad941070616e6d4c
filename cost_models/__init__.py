"""Cost models: hardware descriptions and the analytic models of compute,
communication, memory and schedules that the planner uses to price a plan.

Importing this package does no work: no device probing, no measurement.
"""

from cost_models.cluster_file import ClusterFileError
from cost_models.hardware import Cluster, Device, Link

__all__ = ["Cluster", "ClusterFileError", "Device", "Link"]
