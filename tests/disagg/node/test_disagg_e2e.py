"""Disaggregated serving end to end: real processes, the real libfabric tcp provider (S1-S4, S8).

One prefiller and one or three decoders run as `disagg serve` processes on loopback; a router
sends many concurrent requests. Every request's greedy tokens must equal the single-node
engine's (and transformers' where a reference model exists), and every node must exit 0 after
its shutdown check: no page, request, transfer context or armed counter left behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.apps.demo import PromptSpec, run_demo
from disagg.config import CacheConfig, EngineConfig, ReliabilityConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import load_model
from disagg.node.cluster_config import ClusterConfig

pytestmark = pytest.mark.fabric

MAX_TOKENS = 12


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def single_node_tokens(model: str, prompts: list[list[int]], max_tokens: int,
                       device: str = "cpu") -> list[list[int]]:
    """The reference: the same model on one node, greedy."""
    loaded = load_model(model)
    engine = build_engine(EngineConfig(loaded.config, CacheConfig(page_size=16, num_pages=512),
                                       SchedulerConfig(), device=device), loaded.state_dict)
    requests = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return [r.output_token_ids for r in requests]


def disaggregated_tokens(config: ClusterConfig, prompts: list[list[int]],
                         max_tokens: int) -> tuple[list[list[int]], dict[str, Any]]:
    specs = [PromptSpec(token_ids=p) for p in prompts]
    # A loaded CI machine can be slow; these tests are about tokens, not deadlines.
    config = config.with_node(reliability=ReliabilityConfig(kv_timeout_s=900.0))
    result = run_demo(config, specs, max_tokens, exit_codes=True)
    assert result["exit_codes"] == [0] * (1 + config.num_decoders), result.get("logs")
    unfinished = [(r["request_id"], r["state"], r["detail"]) for r in result["requests"]
                  if r["state"] not in ("finished_length", "finished_stopped")]
    assert not unfinished, unfinished
    return [r["token_ids"] for r in result["requests"]], result


@pytest.mark.slow  # real processes: about 4 s
def test_tiny_one_decoder_matches_single_node() -> None:
    """Prompts of 1 to 40 tokens, chunked mid-page, decode the single-node tokens."""
    prompts = random_prompts([1, 2, 5, 17, 40, 9], vocab_size=512)
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, chunk_size=7)
    ours, result = disaggregated_tokens(config, prompts, MAX_TOKENS)
    assert ours == single_node_tokens("tiny", prompts, MAX_TOKENS)
    # pages x layers + 1 context write per request with something to prefill (S4c).
    expected_writes = sum(-(-(len(p) - 1) // 4) * 2 + 1 for p in prompts if len(p) > 1)
    assert result["totals"]["kv_writes"] == expected_writes


@pytest.mark.gpu_only
def test_cuda_nodes_match_a_cuda_single_node() -> None:
    """Prefiller and decoder on the GPU: KV through the path auto picks (FI_HMEM or staged),
    mapped counter, decode graphs; tokens equal one GPU node's."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU serving path needs one")
    prompts = random_prompts([1, 2, 5, 17, 40, 9], vocab_size=512, seed=5)
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, chunk_size=7,
                                        device="cuda", cuda_graph=True)
    ours, result = disaggregated_tokens(config, prompts, MAX_TOKENS)
    assert ours == single_node_tokens("tiny", prompts, MAX_TOKENS, device="cuda")
    static = [v for k, v in result["metrics"]["decode-0"].items() if "static_decode_steps" in k]
    assert static[0] > 0


@pytest.mark.slow
def test_decoder_with_cuda_graph_matches_single_node() -> None:
    """`serve decode --cuda-graph`: decode steps take the static-buffer path, same tokens."""
    prompts = random_prompts([1, 2, 5, 17, 40, 9], vocab_size=512, seed=3)
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, chunk_size=7,
                                        cuda_graph=True)
    ours, result = disaggregated_tokens(config, prompts, MAX_TOKENS)
    assert ours == single_node_tokens("tiny", prompts, MAX_TOKENS)
    static = [v for k, v in result["metrics"]["decode-0"].items() if "static_decode_steps" in k]
    assert static, "the decoder's metrics have no static decode steps counter"
    assert static[0] > 0


@pytest.mark.slow
@pytest.mark.parametrize(("chunk_size", "kv_layout"), [(3, "NHD"), (64, "HND")])
def test_tiny_three_decoders_many_requests(kv_layout: str, chunk_size: int) -> None:
    """Sixteen concurrent requests over three decoders: many chunks a prompt (a chunk ends
    mid-page) in one layout, one chunk a prompt in the other."""
    prompts = random_prompts([3 + 7 * i for i in range(16)], vocab_size=512, seed=chunk_size)
    config = ClusterConfig.from_options(model="tiny", num_decoders=3, kv_layout=kv_layout,
                                        page_size=5, chunk_size=chunk_size)
    ours, _ = disaggregated_tokens(config, prompts, MAX_TOKENS)
    assert ours == single_node_tokens("tiny", prompts, MAX_TOKENS)


@pytest.mark.slow
def test_hf_checkpoint_matches_transformers(make_hf_llama_checkpoint: Any) -> None:
    """A checkpoint written by transformers, served disaggregated, decodes transformers' tokens."""
    import transformers

    path: Path = make_hf_llama_checkpoint(num_heads=4, num_kv_heads=2, initializer_range=0.2)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    prompts = random_prompts([6, 13, 30], vocab_size=256, seed=5)
    expected = []
    for prompt in prompts:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    config = ClusterConfig.from_options(model=str(path), num_decoders=2, kv_layout="HND",
                                        page_size=4, chunk_size=5)
    specs_tokens, _ = disaggregated_tokens(config, prompts, MAX_TOKENS)
    # Random checkpoints have eos id 2: a request may stop early; compare what was produced.
    assert all(ours == theirs[:len(ours)] for ours, theirs in zip(specs_tokens, expected,
                                                                   strict=True))


@pytest.mark.slow
def test_smollm2_matches_transformers(hf_smollm2_model: Any, hf_smollm2_tokenizer: Any) -> None:
    """SmolLM2 served by 1 prefiller + 2 decoders (HND, chunk 7) decodes transformers' tokens."""
    texts = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of",
             "Once upon a time"]
    prompts = [hf_smollm2_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    expected = []
    for prompt in prompts:
        with torch.inference_mode():
            out = hf_smollm2_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                            do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    config = ClusterConfig.from_options(model="smollm2-135m", num_decoders=2, kv_layout="HND",
                                        page_size=16, chunk_size=7)
    ours, _ = disaggregated_tokens(config, prompts, MAX_TOKENS)
    assert all(o == e[:len(o)] and (len(o) == MAX_TOKENS or o[-1] in (2,))
               for o, e in zip(ours, expected, strict=True))


# Each layout meets equal TP, a wider prefiller and a wider decoder (the two directions in
# which a rank's heads are cut into several regions or gathered from several): pairs, not the
# full product, since every case starts 2-8 processes.
@pytest.mark.slow
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_layout"),
                         [(1, 1, "NHD"), (2, 1, "NHD"), (2, 4, "NHD"),
                          (2, 2, "HND"), (4, 2, "HND"), (1, 2, "HND")])
def test_tensor_parallel_shardings_match_single_node(kv_layout: str, prefill_tp: int,
                                                     decode_tp: int) -> None:
    """Prefill at TP p, decode at TP d (KV split by head, one region per rank): same tokens."""
    prompts = random_prompts([2, 9, 23], vocab_size=512, seed=prefill_tp * 10 + decode_tp)
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, kv_layout=kv_layout,
                                        page_size=4, chunk_size=6, prefill_tp=prefill_tp,
                                        decode_tp=decode_tp)
    ours, result = disaggregated_tokens(config, prompts, MAX_TOKENS)
    assert ours == single_node_tokens("tiny", prompts, MAX_TOKENS)
    # Every rank was its own process (the demo's JSON lists them), and none outlived the run.
    table = result["processes"]
    assert [(p["node"], p["rank"]) for p in table] == (
        [("prefill-0", r) for r in range(prefill_tp)] + [("decode-0", r) for r in range(decode_tp)])
    assert len({p["pid"] for p in table}) == len(table)
    assert not any(Path(f"/proc/{p['pid']}").exists() for p in table)


@pytest.mark.slow
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "num_decoders"),
                         [(4, 2, 1), (2, 1, 3)], ids=["replicated-tp", "replicated-dp"])
def test_replicated_kv_and_dp_decoders_match_single_node(prefill_tp: int, decode_tp: int,
                                                         num_decoders: int) -> None:
    """MLA-style replicated KV (every rank a replica, random source rank per request), with
    TP decoders and with DP decoders (independent engines): same tokens."""
    prompts = random_prompts([5, 14, 30, 3], vocab_size=512, seed=7)
    config = ClusterConfig.from_options(model="tiny", num_decoders=num_decoders, kv_layout="HND",
                                        page_size=4, chunk_size=8, prefill_tp=prefill_tp,
                                        decode_tp=decode_tp, replicated_kv=True)
    ours, _ = disaggregated_tokens(config, prompts, MAX_TOKENS)
    assert ours == single_node_tokens("tiny", prompts, MAX_TOKENS)
