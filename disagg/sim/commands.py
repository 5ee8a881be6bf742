"""Typer commands of the cluster simulator: `simulate`, `plan-cluster`, `calibrate` (S1, S9).

Each command turns options into the simulator's dataclasses, calls one library function and
prints a rich table (or one JSON object with `--json`). `disagg.apps.cli` adds them with
`register(app)`. Bad names and values raise `ConfigError`: one line, exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from disagg.errors import ConfigError
from disagg.sim.cost_model import Parallel
from disagg.sim.hardware import hardware_from_name
from disagg.sim.models import model_from_name
from disagg.sim.simulator import SimClusterConfig
from disagg.sim.workload import Workload
from disagg.utils.optional_deps import use_matplotlib

console = Console()


def _layout(name: str, devices: int) -> Parallel:
    if name not in ("tp", "dp"):
        raise ConfigError(f"unknown decoder layout {name!r}: expected 'tp' or 'dp'")
    return Parallel(tp=devices) if name == "tp" else Parallel(tp=1, dp=devices)


def _print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, allow_nan=False, default=lambda x: None) + "\n")


def _clean(summary: dict[str, float | int]) -> dict[str, float | int | None]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in summary.items()}


def simulate(
    model: Annotated[str, typer.Option(help="deepseek-r1, qwen3-coder-480b, smollm2-135m")]
    = "deepseek-r1",
    gpu: Annotated[str, typer.Option(help="h100, h200 or cpu (after `disagg calibrate`)")]
    = "h200",
    mode: Annotated[str, typer.Option(help="mixed or disagg")] = "disagg",
    prefillers: Annotated[int, typer.Option(help="Prefiller nodes (disagg)")] = 1,
    decoders: Annotated[int, typer.Option(help="Decoder nodes (disagg)")] = 3,
    nodes: Annotated[int | None, typer.Option(help="Mixed nodes (default P + D)")] = None,
    decoder_layout: Annotated[str, typer.Option(help="tp: one TP group per decoder node; "
                                                     "dp: one rank per GPU with EP")] = "tp",
    qps: Annotated[float, typer.Option(help="Poisson arrivals per second, whole cluster")] = 3.0,
    prompt_len: Annotated[int, typer.Option(help="Mean prompt tokens")] = 8192,
    output_len: Annotated[int, typer.Option(help="Mean output tokens")] = 1024,
    duration: Annotated[float, typer.Option(help="Seconds of arrivals")] = 240.0,
    chunk_size: Annotated[int, typer.Option(help="Prefill tokens per step")] = 8192,
    spec_tokens: Annotated[int | None, typer.Option(help="Draft tokens per decode step "
                                                         "(default: the model's MTP)")] = None,
    trace: Annotated[Path | None, typer.Option(help="JSON-lines trace instead of Poisson")]
    = None,
    seed: Annotated[int, typer.Option(help="Arrival and acceptance seed")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    plot: Annotated[Path | None, typer.Option(help="Also sweep load for both modes and save "
                                                   "a PNG here")] = None,
) -> None:
    """Simulate a cluster serving a request stream; TTFT, TPS and ITL percentiles."""
    from disagg.sim.sweep import load_sweep, run_once
    from disagg.sim.workload import load_trace

    if plot is not None:
        use_matplotlib("disagg simulate --plot")  # before the sweep, not after it
    sim_model, hw = model_from_name(model), hardware_from_name(gpu)
    node = Parallel(tp=hw.devices_per_node)
    common = {"prefill_parallel": node, "chunk_size": chunk_size, "spec_tokens": spec_tokens}
    disagg_config = SimClusterConfig(mode="disagg", prefillers=prefillers, decoders=decoders,
                                     decoder_parallel=_layout(decoder_layout, hw.devices_per_node),
                                     **common)  # type: ignore[arg-type]
    mixed_config = SimClusterConfig(mode="mixed", num_nodes=nodes or prefillers + decoders,
                                    **common)  # type: ignore[arg-type]
    config = {"mixed": mixed_config, "disagg": disagg_config}.get(mode)
    if config is None:
        raise ConfigError(f"unknown mode {mode!r}: expected 'mixed' or 'disagg'")
    workload = Workload(qps=qps, prompt_len=prompt_len, output_len=output_len,
                        duration_s=duration, warmup_s=min(30.0, duration / 4), seed=seed)
    summary = run_once(sim_model, hw, config, workload, load_trace(trace) if trace else None)
    result = {"model": model, "gpu": gpu, "mode": mode, "nodes": config.total_nodes,
              **_clean(summary)}
    if plot is not None:
        from disagg.sim.plot import plot_sweep

        sweep = load_sweep(sim_model, hw, {f"mixed x{mixed_config.total_nodes}": mixed_config,
                                           f"disagg {prefillers}P:{decoders}D": disagg_config},
                           workload, [round(qps * f, 3) for f in (0.25, 0.5, 0.75, 1, 1.25,
                                                                  1.5, 2)])
        plot_sweep(sweep, plot, f"{model} on {gpu}: {prompt_len}-token prompts, "
                                f"{output_len}-token outputs")
        result["plot"] = str(plot)
    if as_json:
        _print_json(result)
        return
    table = Table(title=f"{model} on {gpu}, {mode}, {config.total_nodes} nodes, {qps} QPS")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    console.print(table)


def plan_cluster(
    model: Annotated[str, typer.Option(help="deepseek-r1, qwen3-coder-480b, smollm2-135m")]
    = "qwen3-coder-480b",
    gpu: Annotated[str, typer.Option(help="h100, h200 or cpu")] = "h200",
    prompt_len: Annotated[int, typer.Option(help="Mean prompt tokens")] = 8192,
    output_len: Annotated[int, typer.Option(help="Mean output tokens")] = 1024,
    tps: Annotated[float, typer.Option(help="Target decode tokens/s per request")] = 50.0,
    ttft_ms: Annotated[float, typer.Option(help="Target median TTFT")] = 2000.0,
    max_nodes: Annotated[int, typer.Option(help="Largest deployment considered")] = 16,
    top: Annotated[int, typer.Option(help="Options to list")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Pick the P:D ratio and decoder layout with the most QPS per node within a target."""
    from disagg.sim.planner import Target
    from disagg.sim.planner import plan_cluster as make_plan

    plan = make_plan(model_from_name(model), hardware_from_name(gpu), prompt_len, output_len,
                     Target(tps, ttft_ms), max_nodes=max_nodes)
    if as_json:
        _print_json({"best": plan.best.label, "reasoning": plan.reasoning,
                     "options": [{"label": o.label, "nodes": o.nodes, "qps": o.qps,
                                  "qps_per_node": o.goodput_per_node,
                                  "limited_by": o.limited_by} for o in plan.options[:top]]})
        return
    table = Table(title=f"{model} on {gpu}: {tps:.0f} tok/s per request, TTFT {ttft_ms:.0f} ms")
    for column in ("deployment", "nodes", "QPS", "QPS per node", "limited by"):
        table.add_column(column)
    for option in plan.options[:top]:
        table.add_row(option.label, str(option.nodes), f"{option.qps:.2f}",
                      f"{option.goodput_per_node:.3f}", option.limited_by)
    console.print(table)
    for line in plan.reasoning:
        console.print(f"  - {line}", highlight=False)


def calibrate(
    threads: Annotated[int, typer.Option(help="torch threads for every measurement")] = 1,
    save: Annotated[bool, typer.Option(help="Store the preset for `--gpu cpu`")] = True,
    validate: Annotated[bool, typer.Option(help="Time SmolLM2-135M steps against "
                                                "predictions (about a minute)")] = True,
    against: Annotated[Path | None, typer.Option(help="benchmarks/disagg.py runs (JSON) to "
                                                      "predict and compare")] = None,
    quiet_wait: Annotated[float, typer.Option(help="Seconds to wait for an idle CPU before "
                                                    "each measurement")] = 30.0,
    use_saved: Annotated[bool, typer.Option(help="Measure nothing: use the saved preset "
                                                 "(with --against)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Measure this CPU's constants, then predict our engine's step times and compare."""
    from disagg.sim.calibrate import busy_share, calibrate_cpu, validate_steps
    from disagg.sim.hardware import save_cpu_calibration
    from disagg.sim.validate import compare_runs, load_runs

    measuring = validate or not use_saved
    busy_before = busy_share() if measuring else 0.0
    if use_saved:
        hw, path = hardware_from_name("cpu"), None
    else:
        hw = calibrate_cpu(threads=threads, quiet_wait_s=quiet_wait)
        path = save_cpu_calibration(hw) if save else None
    steps = validate_steps(hw, threads=threads, quiet_wait_s=quiet_wait) if validate else []
    runs = compare_runs(load_runs(against), hw) if against else []
    busy = max(busy_before, busy_share()) if measuring else 0.0
    if as_json:
        _print_json({"hardware": hw.to_dict(), "saved_to": str(path) if path else None,
                     "cpu_busy_share": busy,
                     "steps": [{"case": s.case, "predicted_ms": s.predicted_s * 1e3,
                                "measured_ms": s.measured_s * 1e3, "error": s.error}
                               for s in steps],
                     "benchmark": [{"mode": c.mode, "metric": c.metric,
                                    "predicted": c.predicted, "measured": c.measured}
                                   for c in runs]})
        return
    constants = Table(title=f"cpu preset ({threads} thread(s))" + (f", saved to {path}"
                                                                    if path else ""))
    constants.add_column("constant")
    constants.add_column("value", justify="right")
    for key, value in hw.to_dict().items():
        constants.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(constants)
    for title, rows in (("step time: predicted vs measured (ms)",
                         [(s.case, s.predicted_s * 1e3, s.measured_s * 1e3, s.error)
                          for s in steps]),
                        ("benchmarks/disagg.py: predicted vs measured",
                         [(f"{c.mode} {c.metric}", c.predicted, c.measured, c.error)
                          for c in runs])):
        if not rows:
            continue
        table = Table(title=title)
        for column in ("case", "predicted", "measured", "error"):
            table.add_column(column, justify="right")
        for case, predicted, measured, error in rows:
            table.add_row(case, f"{predicted:.1f}", f"{measured:.1f}", f"{error:+.0%}")
        console.print(table)
    if busy > 0.3:
        console.print(f"[yellow]other work used {busy:.0%} of the CPU around the measurement: "
                      "numbers are noisy, run again on a quiet machine[/yellow]")


def register(app: typer.Typer) -> None:
    """Add `simulate`, `plan-cluster` and `calibrate` to the `disagg` app."""
    app.command("simulate")(simulate)
    app.command("plan-cluster")(plan_cluster)
    app.command("calibrate")(calibrate)
