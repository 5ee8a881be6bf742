"""Time of one forward step from first principles: a roofline per term, plus fixed costs (S1).

Attention projections, MLPs and routed experts, attention over the KV cache, the LM head,
TP all-reduce, EP all-to-all, kernel launches and host work, each a separate term so that a
caller can say which one binds. Also the KV transfer over NICs (S3) and cache capacity.
"""

# NOTE on the model. A step runs the same layer `num_layers` times. Within a layer each GEMM
# family and the attention kernel cost max(FLOPs / (peak x efficiency), bytes / (bandwidth x
# efficiency)) on one device (the sum instead of the max on hardware that cannot overlap the
# two, such as one CPU thread). Bytes are what a step must stream once: weights, and the KV
# it reads. So a decode batch (a few tokens per weight) is memory bound and a prefill chunk
# (thousands) compute bound: the S1 asymmetry in one formula. MoE weights grow with the
# experts a batch touches; attention FLOPs with the query-key pairs (qo_len x kv_len).

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from disagg.errors import ConfigError
from disagg.sim.hardware import Hardware
from disagg.sim.models import SimModel

ACTIVATION_BYTES = 2  # bf16 activations on the wire (all-reduce, combine)
DISPATCH_BYTES = 1  # fp8 activations sent to experts (DeepEP dispatch)


@dataclass(frozen=True, slots=True)
class Parallel:
    """How one serving instance maps onto a node's devices.

    `tp` shards attention heads and every weight matrix `tp` ways (MoE experts included).
    `dp > 1` means data-parallel attention: each of `dp` ranks (one device each) runs its own
    batch through replicated attention, and the experts are spread over all `dp` devices
    (expert parallelism), reached by all-to-all. An instance is one TP group or one DP rank.
    """

    tp: int = 8
    dp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ConfigError(f"parallel degrees must be >= 1, got tp={self.tp} dp={self.dp}")
        if self.tp > 1 and self.dp > 1:
            raise ConfigError("choose tp or dp: combined TP x DP instances are not modelled")

    @property
    def devices(self) -> int:
        """Devices of one node the layout spans."""
        return self.tp * self.dp

    @property
    def label(self) -> str:
        """`TP8` or `DP8`."""
        return f"DP{self.dp}" if self.dp > 1 else f"TP{self.tp}"


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one step of one instance computes, summed over its sequences."""

    num_tokens: int  # tokens through the dense layers: the `qo_len` of S1
    num_seqs: int
    num_sample_rows: int  # rows through the LM head
    prefill_pairs: float = 0.0  # query-key pairs of prefill chunks
    decode_pairs: float = 0.0  # query-key pairs of decode chunks
    kv_tokens_read: float = 0.0  # cached tokens each layer reads (sum of kv_len)
    num_loop_seqs: int = 0  # sequences an engine without batched attention loops over

    @staticmethod
    def from_chunks(chunks: Iterable[tuple[int, int]], max_decode_len: int = 1) -> BatchShape:
        """From `(qo_len, context_len)` per sequence; chunks up to `max_decode_len` decode.

        >>> BatchShape.from_chunks([(4, 0)]).prefill_pairs  # causal: 1 + 2 + 3 + 4
        10.0
        """
        tokens = seqs = rows = loop = 0
        prefill = decode = kv = 0.0
        for qo_len, context_len in chunks:
            pairs = qo_len * context_len + qo_len * (qo_len + 1) / 2
            is_decode = qo_len <= max_decode_len and context_len > 0
            decode += pairs if is_decode else 0.0
            prefill += 0.0 if is_decode else pairs
            tokens, seqs, rows = tokens + qo_len, seqs + 1, rows + (qo_len if is_decode else 1)
            kv += context_len + qo_len
            loop += 0 if is_decode else 1
        all_decode = loop == 0
        return BatchShape(tokens, seqs, rows, prefill, decode, kv,
                          0 if all_decode and seqs > 1 else seqs)


@dataclass(slots=True)
class StepCost:
    """Seconds per term of one step, and whether each roofline term is compute or memory bound."""

    terms: dict[str, float] = field(default_factory=dict)
    bound: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """The step's duration."""
        return sum(self.terms.values())

    @property
    def binding_term(self) -> str:
        """The largest term, with its bound: `moe_experts (memory)`."""
        name = max(self.terms, key=self.terms.__getitem__)
        return f"{name} ({self.bound[name]})" if name in self.bound else name


def roofline(flops: float, nbytes: float, flop_rate: float, byte_rate: float,
             overlap: bool = True) -> tuple[float, str]:
    """(seconds, "compute" or "memory") of a kernel doing `flops` over `nbytes` of traffic.

    >>> roofline(2e12, 1e9, flop_rate=1e15, byte_rate=1e12)  # 2 ms of math, 1 ms of bytes
    (0.002, 'compute')
    """
    compute, memory = flops / flop_rate, nbytes / byte_rate
    seconds = max(compute, memory) if overlap else compute + memory
    return seconds, "compute" if compute >= memory else "memory"


def step_cost(model: SimModel, hw: Hardware, parallel: Parallel, shape: BatchShape,
              node_tokens: float | None = None, extra_layers: int = 0) -> StepCost:
    """Cost of one step of one instance (the per-device critical path).

    `node_tokens` is the tokens of every DP rank of the node together (what the shared
    experts see); by default all ranks carry the same batch. `extra_layers` adds layers run
    on top of the model (an MTP draft module).
    """
    cost = StepCost()
    layers = model.num_layers + extra_layers
    moe_layers = model.num_moe_layers + (extra_layers if model.num_experts else 0)
    dense_mlp_layers = layers - moe_layers
    shard = parallel.tp  # devices sharing one instance's weights (1 under DP attention)
    gemm_rate = (hw.fp8_flops if model.weight_bytes <= 1 else hw.bf16_flops) * hw.gemm_efficiency
    byte_rate = hw.hbm_bandwidth * hw.memory_efficiency
    t = shape.num_tokens

    def add(name: str, flops: float, nbytes: float, rate: float) -> None:
        seconds, bound = roofline(flops, nbytes, rate, byte_rate, hw.overlap_compute_memory)
        if seconds >= cost.terms.get(name, 0.0):  # label a term by its larger part
            cost.bound[name] = bound
        cost.terms[name] = cost.terms.get(name, 0.0) + seconds

    # Attention projections, dense MLPs, shared experts and the router: every token, every
    # weight, each layer streaming its own weights.
    router = model.hidden_size * model.num_experts
    moe_layer_params = (model.attention_params + router
                        + model.num_shared_experts * model.expert_params)
    dense_layer_params = model.attention_params + model.dense_mlp_params
    for count, params in ((moe_layers, moe_layer_params), (dense_mlp_layers, dense_layer_params)):
        if count:
            add("dense_gemm", count * 2 * params * t / shard,
                count * params * model.weight_bytes / shard, gemm_rate)

    # Routed experts: weights of the experts this batch touches, FLOPs of k experts per token.
    if moe_layers:
        experts_tokens = t if parallel.dp == 1 else (node_tokens or t * parallel.dp)
        spread = parallel.tp if parallel.dp == 1 else parallel.dp
        active = model.expected_active_experts(experts_tokens)
        flops = 2 * experts_tokens * model.num_experts_per_token * model.expert_params / spread
        nbytes = active * model.expert_params * model.weight_bytes / spread
        add("moe_experts", moe_layers * flops, moe_layers * nbytes, gemm_rate)

    # Attention: FLOPs by query-key pairs, bytes by KV read. MLA's latent is shared by all
    # heads, so TP cannot split it: every rank reads the whole cache (S9a).
    attn_rate = hw.bf16_flops * hw.attention_efficiency
    flops = 0.0
    for pairs, decode in ((shape.prefill_pairs, False), (shape.decode_pairs, True)):
        heads, qk_dim, v_dim = model.attention_dims(decode)
        flops += 2 * heads / shard * (qk_dim + v_dim) * pairs
    kv_split = 1 if model.attention == "mla" else min(shard, model.num_kv_heads)
    nbytes = (shape.kv_tokens_read * model.kv_elems_per_token * model.kv_bytes / kv_split
              * hw.kv_read_passes)
    add("attention", layers * flops, layers * nbytes, attn_rate)

    # LM head, once per step, only for the rows that sample.
    head = model.embedding_params
    add("lm_head", 2 * head * shape.num_sample_rows / shard, head * model.lm_head_bytes / shard,
        gemm_rate)

    link = hw.nvlink_bandwidth * hw.comm_efficiency
    if parallel.tp > 1:  # two all-reduces per layer (attention out, MLP out), ring algorithm
        nbytes = t * model.hidden_size * ACTIVATION_BYTES
        ring = 2 * (parallel.tp - 1) / parallel.tp * nbytes / link
        cost.terms["tp_allreduce"] = 2 * layers * (hw.collective_latency_s + ring)
    if parallel.dp > 1 and moe_layers:  # dispatch (fp8) and combine (bf16) per MoE layer
        remote = (parallel.dp - 1) / parallel.dp
        nbytes = t * model.num_experts_per_token * model.hidden_size \
            * (DISPATCH_BYTES + ACTIVATION_BYTES) * remote
        cost.terms["ep_alltoall"] = moe_layers * (2 * hw.collective_latency_s + nbytes / link)

    cost.terms["kernel_overhead"] = layers * model.kernels_per_layer * hw.kernel_overhead_s
    cost.terms["host_overhead"] = (hw.step_overhead_s + hw.seq_overhead_s * shape.num_seqs
                                   + hw.seq_layer_overhead_s * shape.num_loop_seqs * layers)
    return cost


def step_time(model: SimModel, hw: Hardware, parallel: Parallel, shape: BatchShape,
              node_tokens: float | None = None, extra_layers: int = 0) -> float:
    """Seconds of one step (`step_cost(...).total`)."""
    return step_cost(model, hw, parallel, shape, node_tokens, extra_layers).total


def tokens_per_step(spec_tokens: int, acceptance: float) -> float:
    """Expected tokens a decode step yields with `spec_tokens` drafts accepted with `acceptance`.

    >>> round(tokens_per_step(1, 0.85), 2)  # DeepSeek-V3's MTP: one draft, 85-90% accepted
    1.85
    """
    return sum(acceptance ** i for i in range(spec_tokens + 1))


def decode_shape(batch: int, kv_len: float, spec_tokens: int = 0) -> BatchShape:
    """`batch` sequences decoding `1 + spec_tokens` tokens each over `kv_len` cached tokens."""
    qo = 1 + spec_tokens
    pairs = batch * (qo * kv_len + qo * (qo + 1) / 2)
    return BatchShape(batch * qo, batch, batch * qo, decode_pairs=pairs,
                      kv_tokens_read=batch * (kv_len + qo), num_loop_seqs=0 if batch > 1 else 1)


def prefill_time(model: SimModel, hw: Hardware, parallel: Parallel, prompt_len: int,
                 chunk_size: int) -> float:
    """Seconds to prefill one prompt alone, `chunk_size` tokens per step."""
    seconds, done = 0.0, 0
    while done < prompt_len:
        qo = min(chunk_size, prompt_len - done)
        seconds += step_time(model, hw, parallel, BatchShape.from_chunks([(qo, done)]))
        done += qo
    return seconds


@dataclass(frozen=True, slots=True)
class TransferCost:
    """A prompt's KV cache over the NICs: the whole stream, and the part left after the
    prefill's last layer (all that shows in TTFT when streaming layer by layer, S3)."""

    nbytes: float
    stream_s: float
    tail_s: float


def kv_transfer(model: SimModel, hw: Hardware, num_tokens: int, last_chunk_tokens: int,
                num_nics: int) -> TransferCost:
    """KV bytes of `num_tokens` sent over `num_nics` NICs; the tail is the last chunk's last
    layer plus the context copy (S4a: one hidden state) plus one write's latency.

    MLA ships 576 elements per token per layer, GQA 2 x kv_heads x head_dim: R1 moves about
    69 KB per token, Qwen3-Coder about 248 KB.
    """
    bandwidth = num_nics * hw.nic_bandwidth * hw.comm_efficiency
    nbytes = num_tokens * model.kv_bytes_per_token
    last_layer = last_chunk_tokens * model.kv_elems_per_token * model.kv_bytes
    context = model.hidden_size * ACTIVATION_BYTES
    return TransferCost(nbytes, nbytes / bandwidth + hw.nic_latency_s,
                        (last_layer + context) / bandwidth + hw.nic_latency_s)


def kv_capacity_tokens(model: SimModel, hw: Hardware, parallel: Parallel,
                       fraction: float) -> float:
    """Tokens of KV cache one instance holds once its weights are loaded."""
    shard = parallel.tp
    moe = model.num_moe_layers * model.num_experts * model.expert_params
    per_device = (model.total_params - moe) * model.weight_bytes / shard \
        + moe * model.weight_bytes / parallel.devices
    free = (hw.hbm_capacity - per_device) * fraction
    if free <= 0:
        raise ConfigError(f"{model.name} does not fit on {parallel.label} of {hw.name}: "
                          f"{per_device / 1e9:.0f} GB of weights per device")
    kv_split = 1 if model.attention == "mla" else min(shard, model.num_kv_heads)
    return free * kv_split / model.kv_bytes_per_token
