"""Run the simulator once or across loads: the numbers behind `disagg simulate` (S1, S9c).

`run_once` serves one workload (Poisson, or the arrivals of a trace) on one deployment and
returns the summary; `load_sweep` repeats it over offered loads for several deployments.
"""

from __future__ import annotations

from dataclasses import replace

from disagg.sim.hardware import Hardware
from disagg.sim.models import SimModel
from disagg.sim.simulator import ClusterSimulator, SimClusterConfig
from disagg.sim.workload import Arrival, Workload, poisson_arrivals

Sweep = dict[str, list[dict[str, float | int]]]


def run_once(model: SimModel, hw: Hardware, config: SimClusterConfig, workload: Workload,
             arrivals: list[Arrival] | None = None) -> dict[str, float | int]:
    """One simulation's summary with the offered `qps` added (a trace's own rate if given)."""
    if arrivals is None:
        arrivals, qps, warmup = poisson_arrivals(workload), workload.qps, workload.warmup_s
    else:
        span = max(arrivals[-1].time, 1e-9)
        qps, warmup = len(arrivals) / span, 0.0
    simulator = ClusterSimulator(model, hw, config, seed=workload.seed)
    end = max(workload.duration_s, arrivals[-1].time if arrivals else 0.0)
    result = simulator.run(arrivals, warmup, horizon_s=4 * end + 120)
    return {"qps": qps, **result.summary()}


def load_sweep(model: SimModel, hw: Hardware, configs: dict[str, SimClusterConfig],
               workload: Workload, qps_values: list[float]) -> Sweep:
    """For each named deployment, the summary at each offered QPS."""
    return {label: [run_once(model, hw, config, replace(workload, qps=qps))
                    for qps in qps_values]
            for label, config in configs.items()}


