"""Step 9: why disaggregate, in numbers (S1, S9). Runs on a laptop CPU in a few seconds.

No model runs here: the cost model prices one forward step of DeepSeek-R1 on an 8 x H200 node
from datasheet peaks, then a discrete-event simulator serves the same request stream on four
nodes twice, mixed and disaggregated (1 prefiller : 3 decoders), and the planner sizes a
Qwen3-Coder deployment. Pairs with docs/tutorials/09-why-disaggregate.md.
"""

from __future__ import annotations

from disagg.sim.cost_model import BatchShape, Parallel, decode_shape, step_cost
from disagg.sim.hardware import hardware_from_name
from disagg.sim.models import model_from_name
from disagg.sim.planner import Target, plan_cluster
from disagg.sim.simulator import SimClusterConfig
from disagg.sim.sweep import run_once
from disagg.sim.workload import Workload


def show_step_costs() -> None:
    """S1: a decode batch streams weights; a prefill chunk is compute bound and far slower."""
    r1, h200, tp8 = model_from_name("deepseek-r1"), hardware_from_name("h200"), Parallel(tp=8)
    steps = {"16 decodes, 8k context each": decode_shape(16, 8192),
             "16 decodes + one 8k-token chunk": BatchShape.from_chunks(
                 [(1, 8192)] * 16 + [(8192 - 16, 0)])}
    for name, shape in steps.items():
        cost = step_cost(r1, h200, tp8, shape)
        terms = ", ".join(f"{term} {seconds * 1e3:.1f}" for term, seconds in cost.terms.items()
                          if seconds * 1e3 >= 0.5)
        print(f"{name}: {cost.total * 1e3:.0f} ms, binding {cost.binding_term}")
        print(f"    ms by term: {terms}")


def compare_modes() -> None:
    """The same 3 QPS stream of 8k-token prompts on four nodes, served two ways."""
    r1, h200 = model_from_name("deepseek-r1"), hardware_from_name("h200")
    workload = Workload(qps=3.0, duration_s=90, warmup_s=15)
    print(f"\nDeepSeek-R1 on 4 x 8 H200, {workload.qps} QPS, {workload.prompt_len}-token "
          f"prompts, {workload.output_len}-token outputs, MTP on:")
    print(f"{'mode':>16} {'TPS p50':>8} {'TTFT p50':>9} {'ITL p99':>8} {'ITL max':>8}")
    for name, config in (("mixed x4", SimClusterConfig(mode="mixed", num_nodes=4)),
                         ("disagg 1P:3D", SimClusterConfig(mode="disagg"))):
        s = run_once(r1, h200, config, workload)
        print(f"{name:>16} {s['tps_per_request_p50']:>8.0f} {s['ttft_ms_p50']:>7.0f}ms "
              f"{s['itl_ms_p99']:>6.0f}ms {s['itl_ms_max']:>6.0f}ms")


def size_qwen() -> None:
    """S9b: how many decoder nodes one Qwen3-Coder prefiller node feeds at 50 tok/s."""
    plan = plan_cluster(model_from_name("qwen3-coder-480b"), hardware_from_name("h200"),
                        prompt_len=8192, output_len=1024, target=Target(50, 2000))
    print("\nQwen3-Coder-480B plan (8k prompts, 1k outputs, 50 tok/s per request):")
    for line in plan.reasoning:
        print(f"  - {line}")


def main() -> None:
    show_step_costs()
    compare_modes()
    size_qwen()


if __name__ == "__main__":
    main()
