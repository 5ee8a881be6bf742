"""Cluster simulator: first-principles step times, a discrete-event cluster, a P:D planner.

Models DeepSeek-R1 and Qwen3-Coder deployments on H100/H200 nodes (and this machine's CPU)
to show why disaggregation pays (S1) and which P:D ratio a workload needs (S9). Nothing here
runs a model; `disagg.engine.llm_engine` does that.
"""

from __future__ import annotations

from disagg.sim.cost_model import BatchShape, Parallel, StepCost, step_cost, step_time
from disagg.sim.hardware import Hardware, hardware_from_name
from disagg.sim.models import SimModel, model_from_name
from disagg.sim.planner import Plan, Target, plan_cluster
from disagg.sim.simulator import ClusterSimulator, SimClusterConfig
from disagg.sim.workload import Arrival, Workload, poisson_arrivals

__all__ = ["Arrival", "BatchShape", "ClusterSimulator", "Hardware", "Parallel", "Plan",
           "SimClusterConfig", "SimModel", "StepCost", "Target", "Workload",
           "hardware_from_name", "model_from_name", "plan_cluster", "poisson_arrivals",
           "step_cost", "step_time"]
