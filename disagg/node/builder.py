"""The one place a node is wired: model, engine, fabric, messenger, plug-ins (S2, S3b, S5).

`build_node(config)` loads the model, opens the transfer engine and constructs every object a
node of `config.role` needs, handing each its collaborators once:
- prefiller: the layer counter goes into the model it bumps and the messenger whose poller
  watches it; the messenger is the engine's step observer; the draft-KV plug-in is a factory
  the messenger calls when a decoder first asks for it (S8);
- decoder: a speculator (when asked for) observes and finishes the engine's steps, and its MTP
  cache becomes the messenger's draft-KV sink;
- both: the messenger's `wake` rings the node's inbox.
Nothing is re-attached afterwards. On CUDA the transfer engine asks for FI_HMEM first and falls
back to host staging (S5, `transfer_core.staging`). With `--tp N` the node is the leader of N
rank processes (`disagg.parallel.leader`): it holds rank 0's shard only (this process loads the
config and tokenizer, the leader reads rank 0's slices, each rank its own), maps every rank's
KV into the one transfer engine, and a rank that dies fails the node through its inbox. The
model fingerprint both sides compare at handshake comes from the spec and dtype, never from
weights in memory (`model_fingerprint`), so it is the same at every TP degree.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import partial

import torch

from disagg.config import EngineConfig
from disagg.engine.guided import GuideCompiler
from disagg.engine.llm_engine import EngineParts, LLMEngine, build_model
from disagg.errors import ConfigError
from disagg.kv_transfer.decode_messenger import DecodeMessenger
from disagg.kv_transfer.draft_kv import DraftKVSink, DraftKVSource
from disagg.kv_transfer.prefill_messenger import PrefillMessenger
from disagg.model.layer_counter import LayerCounter
from disagg.model.loading.fingerprint import model_fingerprint
from disagg.model.loading.registry import LoadedModel, ModelTokenizer, load_model, load_tokenizer
from disagg.model.transformer import Transformer
from disagg.node.base import Inbox
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole, check_device
from disagg.node.prefill_node import PrefillNode
from disagg.node.rank_placement import NodePlacement, plan_placement
from disagg.parallel.leader import TPLeader
from disagg.speculative.speculator import Speculator
from disagg.utils.trace import Tracer, trace_path
from transfer_core.engine import TransferEngine
from transfer_core.faults import FaultPlan, FaultyTransport
from transfer_core.shm_sweep import sweep_dead_shm_files
from transfer_core.staging import open_engine
from transfer_core.topology import detect_topology
from transfer_core.transport import Transport

logger = logging.getLogger(__name__)


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory instead of returning it to the kernel at every free.

    Each decode step gathers megabytes of KV per layer; with glibc's default thresholds that
    memory is unmapped on free and faulted back in (and zeroed) by the next layer, which made a
    decoder node's steps 2-2.5 times slower than the same batch in a long-lived process.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


# What a node process loads: the whole model at TP 1, only its config and tokenizer at TP > 1.
NodeModel = LoadedModel | ModelTokenizer


def node_model(config: NodeConfig) -> NodeModel:
    """What this process loads of `config.model`: every weight at TP 1; at TP > 1 only the
    config and tokenizer, since the leader reads rank 0's slices of each split weight itself
    and each rank its own (a TP node never holds the whole model)."""
    if config.parallel.tp > 1:
        return load_tokenizer(config.model)
    return load_model(config.model)


def build_node(config: NodeConfig, tracer: Tracer | None = None,
               placement: NodePlacement | None = None) -> PrefillNode | DecodeNode:
    """Load the model, open the fabric and wire one node of `config.role`; `placement` is
    where its ranks' domains and cores are (default: from this machine's sysfs)."""
    check_device(config.device)  # before the model loads: this machine must have it
    keep_freed_memory()
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = node_model(config)
    tracer = tracer or Tracer(trace_path(config.trace, config.node_id), config.node_id,
                              otlp_endpoint=config.otlp_endpoint)
    placement = placement or node_placement(config)
    transfer = open_transfer(config, placement)
    try:
        if config.role is NodeRole.PREFILL:
            return _prefill_node(config, loaded, transfer, tracer, placement)
        return _decode_node(config, loaded, transfer, tracer, placement)
    except BaseException:
        transfer.close()
        raise


def node_fingerprint(config: NodeConfig, loaded: NodeModel) -> str:
    """The model fingerprint this node shows peers at handshake (any TP degree)."""
    return model_fingerprint(config.model, loaded.config, config.dtype)


def _engine_config(config: NodeConfig, loaded: NodeModel) -> EngineConfig:
    return EngineConfig(loaded.config, config.cache, config.scheduler, config.parallel,
                        device=config.device, dtype=config.dtype, cuda_graph=config.cuda_graph)


def _model(config: NodeConfig, engine_config: EngineConfig, loaded: NodeModel, inbox: Inbox,
           counter: LayerCounter | None = None) -> Transformer | TPLeader:
    """The node's model: one process at TP 1, else the leader of its rank processes (given
    no weights: it reads rank 0's slices), a rank's death failing the node through its inbox."""
    state_dict = loaded.state_dict if isinstance(loaded, LoadedModel) else None
    return build_model(engine_config, state_dict, counter,
                       model_spec=config.model, threads=config.threads,
                       node_id=config.node_id, on_failure=inbox.fail)


def _prefill_node(config: NodeConfig, loaded: NodeModel, transfer: Transport,
                  tracer: Tracer, placement: NodePlacement) -> PrefillNode:
    inbox = Inbox()
    engine, messenger = build_prefill_side(config, loaded, transfer, inbox, tracer, placement)
    return PrefillNode(engine, messenger, transfer, inbox, node_fingerprint(config, loaded),
                       config.listen, config.node_id, tracer)


def build_prefill_side(config: NodeConfig, loaded: NodeModel, transport: Transport,
                       inbox: Inbox, tracer: Tracer, placement: NodePlacement | None = None,
                       ) -> tuple[LLMEngine, PrefillMessenger]:
    """A prefiller's engine and messenger over `transport`, wired (the node adds its control
    plane). Without a `placement`, writes may leave through any domain and the poller is not
    pinned (in-process tests over a loopback transport)."""
    parts, counter = prefill_parts(config, loaded, inbox)
    return wire_prefill_side(config, parts, counter, transport, inbox, tracer, placement)


def prefill_parts(config: NodeConfig, loaded: NodeModel, inbox: Inbox,
                  ) -> tuple[EngineParts, LayerCounter]:
    """A prefiller's model, KV cache, allocator and scheduler, and the counter its model bumps
    after each layer (S3b)."""
    engine_config = _engine_config(config, loaded)
    counter = LayerCounter.for_device(config.device)
    parts = EngineParts.build(engine_config, _model(config, engine_config, loaded, inbox, counter))
    return parts, counter


def wire_prefill_side(config: NodeConfig, parts: EngineParts, counter: LayerCounter,
                      transport: Transport, inbox: Inbox, tracer: Tracer,
                      placement: NodePlacement | None = None,
                      ) -> tuple[LLMEngine, PrefillMessenger]:
    """The messenger over `parts`' KV, the engine whose step observer it is; `counter` is the
    one `parts.model` bumps."""
    rank_domains = None if placement is None else [r.domains for r in placement.ranks]
    poller_cpus = None if placement is None else allowed(placement.ranks[0].cpus) or None
    messenger = PrefillMessenger(parts, transport, counter, wake=inbox.wake,
                                 make_draft_source=partial(DraftKVSource, parts, transport),
                                 tracer=tracer, lease_s=config.lease_s,
                                 rank_domains=rank_domains, poller_cpus=poller_cpus,
                                 min_post_bytes=config.min_post_bytes)
    return LLMEngine(parts, observers=[messenger]), messenger


def _decode_node(config: NodeConfig, loaded: NodeModel, transfer: Transport,
                 tracer: Tracer, placement: NodePlacement) -> DecodeNode:
    inbox = Inbox()
    engine, messenger = build_decode_side(config, loaded, transfer, inbox, placement)
    if engine.runner.graphs is not None:
        engine.runner.graphs.capture_all()  # before serving, not during a first decode
    try:
        return DecodeNode(engine, messenger, transfer, inbox, config.prefillers, config.listen,
                          config.node_id, tracer)
    except BaseException:
        messenger.close()
        raise


def build_decode_side(config: NodeConfig, loaded: NodeModel, transport: Transport,
                      inbox: Inbox, placement: NodePlacement | None = None,
                      ) -> tuple[LLMEngine, DecodeMessenger]:
    """A decoder's engine (with its speculator, if asked for) and messenger over `transport`,
    wired (the node adds its control plane and prefillers). Without a `placement`, every
    rank's KV is reachable through every domain."""
    return wire_decode_side(config, loaded, decode_parts(config, loaded, inbox), transport,
                            inbox, placement)


def decode_parts(config: NodeConfig, loaded: NodeModel, inbox: Inbox) -> EngineParts:
    """A decoder's model, KV cache, allocator and scheduler."""
    engine_config = _engine_config(config, loaded)
    if config.speculative is not None and config.speculative.kind == "mtp":
        if engine_config.cache.prefix_caching:
            # The MTP head keeps its own KV per page, shipped with the target's: a page reused
            # from the cache would come without it. So an MTP decoder caches no prefixes.
            logger.info("prefix caching is off on this decoder: its MTP head needs every page")
        engine_config = engine_config.with_cache(prefix_caching=False)
    return EngineParts.build(engine_config, _model(config, engine_config, loaded, inbox),
                             GuideCompiler.for_model(loaded))


def wire_decode_side(config: NodeConfig, loaded: NodeModel, parts: EngineParts,
                     transport: Transport, inbox: Inbox, placement: NodePlacement | None = None,
                     ) -> tuple[LLMEngine, DecodeMessenger]:
    """The speculator (when asked for), the messenger over `parts`' KV (rank r's written
    through rank r's domains, S5b) and the engine."""
    speculator = None if config.speculative is None else Speculator(parts, config.speculative)
    sink = None
    if speculator is not None and speculator.kv_cache is not None:  # an MTP head (S4a, S8)
        sink = DraftKVSink(speculator.kv_cache, loaded.config, config.cache.page_size, transport)
    messenger = DecodeMessenger(parts, transport, config.node_id,
                                node_fingerprint(config, loaded),
                                wake=inbox.wake, draft_sink=sink,
                                reliability=config.reliability,
                                rank_domains=None if placement is None else
                                [r.domains for r in placement.ranks])
    engine = LLMEngine(parts, observers=[] if speculator is None else [speculator],
                       finisher=speculator)
    return engine, messenger


def allowed(cpus: tuple[int, ...]) -> tuple[int, ...]:
    """The cores of `cpus` this process may run on: a node started under taskset, a cgroup
    cpuset, SLURM or Ray pins within its share, never outside it."""
    mine = os.sched_getaffinity(0)
    return tuple(cpu for cpu in cpus if cpu in mine)


def node_placement(config: NodeConfig, sysfs_root: str | os.PathLike[str] = "/"
                   ) -> NodePlacement:
    """Which domains and cores each of the node's TP ranks uses, from the sysfs under
    `sysfs_root` (this machine's by default). A GPU sysfs does not show (a container may hide
    the PCI tree; CUDA already said the device exists) gets stand-in domains and no affinity,
    with a warning, not a refusal."""
    topology = detect_topology(sysfs_root)
    try:
        return plan_placement(topology, config.parallel.tp, config.device,
                              config.domains_per_rank)
    except ConfigError as error:
        if torch.device(config.device).type != "cuda":
            raise
        logger.warning("%s: its ranks get stand-in domains and no NIC or CPU affinity", error)
        return plan_placement(topology, config.parallel.tp, "cpu", config.domains_per_rank)


def open_transfer(config: NodeConfig, placement: NodePlacement | None = None) -> Transport:
    """The node's transfer engine: one domain per entry of `placement` (rank i's NICs, or
    stand-ins), each progress thread pinned to its rank's cores (S5b). KV on CUDA with path
    auto or hmem asks for FI_HMEM first; without a provider that has it, the engine opens
    without, so auto stages through host memory and hmem fails at registration with the
    provider's name (both say why). With `config.faults` (tests) the engine is wrapped in a
    `FaultyTransport` of that plan."""
    want_hmem = (torch.device(config.device).type == "cuda"
                 and config.kv_memory_path in ("auto", "hmem"))
    placement = placement or node_placement(config)
    domain_cpus = [allowed(cpus) for cpus in placement.domain_cpus]
    num_domains = placement.num_domains
    nics = list(placement.domain_nics) if any(placement.domain_nics) else None

    def make(hmem: bool) -> TransferEngine:
        return TransferEngine(config.provider, config.fabric_node, num_domains,
                              hmem=hmem, memory_path=config.kv_memory_path,
                              domain_cpus=domain_cpus if all(domain_cpus) else None, nics=nics)

    plan = FaultPlan.parse(config.faults) if config.faults else None  # before opening: it may fail
    if "shm" in config.provider:
        sweep_dead_shm_files()  # what nodes killed with SIGKILL left behind (16 MiB each)
    engine = open_engine(make, want_hmem)
    return engine if plan is None else FaultyTransport(engine, plan)
