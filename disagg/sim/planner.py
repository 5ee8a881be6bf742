"""P:D planner: the prefiller-to-decoder ratio and layout that serve the most QPS per node (S9b).

For a model, hardware, workload (mean prompt and output lengths) and latency target (tokens/s
per request, TTFT), it sizes three pools with the cost model: how many QPS one decoder node
sustains at the target TPS (TP or DP layout), one prefiller node at the TTFT target, and one
mixed node. The best integer P:D is the one whose slower side carries the most QPS per node.
Every number is a mean-field estimate (Little's law, an M/D/1 queue at the prefiller); run
the chosen plan through the simulator (`verify`) for percentiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from disagg.errors import ConfigError
from disagg.sim.cost_model import (
    BatchShape,
    Parallel,
    StepCost,
    decode_shape,
    kv_capacity_tokens,
    kv_transfer,
    prefill_time,
    step_cost,
    tokens_per_step,
)
from disagg.sim.hardware import Hardware
from disagg.sim.models import SimModel

MAX_PREFILL_UTILISATION = 0.8  # beyond this the prefiller queue, hence TTFT, explodes


@dataclass(frozen=True, slots=True)
class Target:
    """What every request should get: decode speed and (mean-field, median) TTFT."""

    tps_per_request: float = 50.0
    ttft_ms: float = 2000.0

    def __post_init__(self) -> None:
        if self.tps_per_request <= 0 or self.ttft_ms <= 0:
            raise ConfigError("the TPS and TTFT targets must be positive")


@dataclass(frozen=True, slots=True)
class PoolCapacity:
    """QPS one node of a pool sustains within the target, and the step that limits it."""

    role: str  # prefill, decode or mixed
    parallel: Parallel
    qps_per_node: float
    batch: int  # concurrent requests per instance at that load (0 for prefill)
    tps: float  # tokens/s per request at that load (0 for prefill)
    step_ms: float  # the representative step: a decode step, or the whole prefill
    cost: StepCost
    limit: str  # what stops more load: the TPS target, KV capacity, TTFT, utilisation


@dataclass(frozen=True, slots=True)
class PlanOption:
    """One deployment and the QPS it serves within the target."""

    label: str
    prefillers: int  # 0 for mixed
    decoders: int  # mixed: nodes
    decoder_parallel: Parallel
    qps: float
    limited_by: str

    @property
    def nodes(self) -> int:
        """Nodes the option uses."""
        return self.prefillers + self.decoders

    @property
    def goodput_per_node(self) -> float:
        """QPS per node within the target: what the planner maximises."""
        return self.qps / self.nodes


@dataclass
class Plan:
    """Every option ranked by goodput per node, and the reasoning behind the best."""

    options: list[PlanOption]
    pools: dict[str, PoolCapacity]
    reasoning: list[str] = field(default_factory=list)

    @property
    def best(self) -> PlanOption:
        """The option with the highest goodput per node."""
        return self.options[0]


def decode_capacity(model: SimModel, hw: Hardware, parallel: Parallel, prompt_len: int,
                    output_len: int, target: Target, spec: int, acceptance: float,
                    max_batch: int = 512) -> PoolCapacity | None:
    """The largest decode batch per instance that still reaches the TPS target (None if none)."""
    kv_len = prompt_len + output_len / 2
    kv_limit = kv_capacity_tokens(model, hw, parallel, 0.9) // (prompt_len + output_len)
    found = None
    for batch in range(1, min(max_batch, int(kv_limit)) + 1):
        cost = step_cost(model, hw, parallel, decode_shape(batch, kv_len, spec),
                         extra_layers=model.mtp_layers if spec else 0)
        tps = tokens_per_step(spec, acceptance) / cost.total
        if tps < target.tps_per_request:
            return found
        qps = batch * tps / output_len * parallel.dp
        found = PoolCapacity("decode", parallel, qps, batch, tps, cost.total * 1e3, cost,
                             "TPS target")
    return None if found is None else replace(found, limit="KV capacity or batch cap")


def prefill_capacity(model: SimModel, hw: Hardware, parallel: Parallel, prompt_len: int,
                     chunk_size: int, ttft_budget_s: float) -> PoolCapacity:
    """QPS one prefill node takes with its M/D/1 queue inside the TTFT budget."""
    service = prefill_time(model, hw, parallel, prompt_len - 1, chunk_size)
    cost = step_cost(model, hw, parallel,
                     BatchShape.from_chunks([(min(chunk_size, prompt_len - 1), 0)]))
    # Mean M/D/1 wait is rho * S / (2 (1 - rho)); solve wait + S <= budget for rho.
    slack = ttft_budget_s - service
    rho = 0.0 if slack <= 0 else 2 * slack / (service + 2 * slack)
    limit = "TTFT target" if rho < MAX_PREFILL_UTILISATION else "utilisation cap 80%"
    rho = min(rho, MAX_PREFILL_UTILISATION)
    return PoolCapacity("prefill", parallel, rho / service, 0, 0.0, service * 1e3, cost, limit)


def mixed_capacity(model: SimModel, hw: Hardware, parallel: Parallel, prompt_len: int,
                   output_len: int, target: Target, spec: int, acceptance: float,
                   chunk_size: int) -> PoolCapacity | None:
    """QPS per mixed node: decodes run at full speed only in the time prefills leave them."""
    prefill = prefill_time(model, hw, parallel, prompt_len, chunk_size)
    kv_len = prompt_len + output_len / 2

    def tps_at(qps: float) -> tuple[float, int, StepCost]:
        stall = qps * prefill  # share of time the node spends on prompts
        batch, cost, tps = 1, StepCost(), 0.0
        for _ in range(40):  # fixed point of batch = qps * output_len / tps
            cost = step_cost(model, hw, parallel, decode_shape(batch, kv_len, spec),
                             extra_layers=model.mtp_layers if spec else 0)
            tps = tokens_per_step(spec, acceptance) / cost.total * max(0.0, 1 - stall)
            batch = max(1, round(qps * output_len / tps)) if tps > 0 else 10**6
        return tps, batch, cost

    low, high = 0.0, 1.0 / prefill
    if tps_at(1e-6)[0] < target.tps_per_request or prefill > target.ttft_ms / 1e3:
        return None
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if tps_at(mid)[0] >= target.tps_per_request else (low, mid)
    tps, batch, cost = tps_at(low)
    return PoolCapacity("mixed", parallel, low, batch, tps, cost.total * 1e3, cost,
                        f"TPS target (prefill stalls take {low * prefill:.0%} of the time)")


def plan_cluster(model: SimModel, hw: Hardware, prompt_len: int, output_len: int,
                 target: Target, max_nodes: int = 16, chunk_size: int = 8192,
                 spec: int | None = None, acceptance: float = 0.85) -> Plan:
    """Rank mixed and every P:D (TP or DP decoders) up to `max_nodes` by goodput per node."""
    spec = model.mtp_layers if spec is None else spec
    tp, dp = Parallel(tp=hw.devices_per_node), Parallel(tp=1, dp=hw.devices_per_node)
    pools: dict[str, PoolCapacity] = {}
    for name, parallel in (("decode TP", tp), ("decode DP", dp)):
        pool = decode_capacity(model, hw, parallel, prompt_len, output_len, target, spec,
                               acceptance)
        if pool is not None:
            pools[name] = pool
    decode_tail = min((p.step_ms for p in pools.values()), default=0.0) * 1.5e-3
    transfer = kv_transfer(model, hw, prompt_len, chunk_size, 1).tail_s
    pools["prefill"] = prefill_capacity(model, hw, tp, prompt_len, chunk_size,
                                        target.ttft_ms / 1e3 - decode_tail - transfer)
    mixed = mixed_capacity(model, hw, tp, prompt_len, output_len, target, spec, acceptance,
                           chunk_size)
    options = []
    if mixed is not None:
        pools["mixed"] = mixed
        options.append(PlanOption(f"mixed {tp.label} (any node count)", 0, 1, tp,
                                  mixed.qps_per_node, "prefill stalls"))
    pre = pools["prefill"].qps_per_node
    for name in ("decode TP", "decode DP"):
        if name not in pools or pre <= 0:
            continue
        dec = pools[name]
        for p in range(1, max_nodes):
            for d in range(1, max_nodes - p + 1):
                qps = min(p * pre, d * dec.qps_per_node)
                side = "prefillers" if p * pre < d * dec.qps_per_node else "decoders"
                options.append(PlanOption(f"{p}P:{d}D {dec.parallel.label}", p, d,
                                          dec.parallel, qps, side))
    if not options:
        raise ConfigError(f"no deployment of {model.name} on {hw.name} reaches "
                          f"{target.tps_per_request:.0f} tok/s within {target.ttft_ms:.0f} ms")
    options.sort(key=lambda o: (-round(o.goodput_per_node, 6), o.nodes))
    return Plan(options, pools, _reasoning(pools, options[0]))


def _reasoning(pools: dict[str, PoolCapacity], best: PlanOption) -> list[str]:
    lines = []
    for name, pool in pools.items():
        if pool.role == "prefill":
            lines.append(f"{name} {pool.parallel.label}: one prompt takes {pool.step_ms:.0f} ms "
                         f"(binding: {pool.cost.binding_term}); {pool.qps_per_node:.2f} QPS "
                         f"per node ({pool.limit})")
        else:
            lines.append(f"{name}: batch {pool.batch} per instance, step {pool.step_ms:.1f} ms "
                         f"(binding: {pool.cost.binding_term}) -> {pool.tps:.0f} tok/s, "
                         f"{pool.qps_per_node:.2f} QPS per node ({pool.limit})")
    for name in ("decode TP", "decode DP"):
        if name in pools and pools["prefill"].qps_per_node > 0:
            ratio = pools["prefill"].qps_per_node / pools[name].qps_per_node
            lines.append(f"one prefiller feeds {ratio:.1f} {name} nodes")
    lines.append(f"best: {best.label}, {best.qps:.2f} QPS on {best.nodes} nodes = "
                 f"{best.goodput_per_node:.2f} QPS per node (limited by {best.limited_by})")
    return lines
