"""Our engine in bfloat16 and float16 against transformers in the same precision (S3b, S9a, S9b).

Random tiny Llama (llama3 RoPE scaling), Qwen3 (q/k norms), Qwen3-MoE and DeepSeek-V3 (MLA, a
dense then a sparse layer) models are built by transformers in float32 and saved; the reference
is transformers' `from_pretrained(dtype=...)` of that checkpoint (eager attention), and our
engine runs at `dtype` with its KV cache in the same dtype. Not `model.to(dtype)`: that also
rounds RoPE's `inv_freq` buffer and casts DeepSeek-V3's router, which transformers keeps in
float32 when it loads a model in half precision (`_keep_in_fp32_modules_strict`, and buffers
computed in float32 at init); we compare with what transformers serves.

The tolerance. The two sides run the same math in the same dtype but round in different places
(PyTorch's fused attention here, eager matmul + float32 softmax there; packed batches), so
their logits are not bit-equal. Measured over six 24-token prompts on these models, the
largest |ours - transformers| of a prefill's logits was 4.2 (bf16) and 3.1 (fp16) times the
dtype's epsilon times the largest logit (bf16: 0.25 of 7.7), the same size as transformers'
own distance from float32. `TOLERANCE_EPS` allows 6. A greedy choice between two tokens whose
logits are closer than that can go either way: where tokens differ, the first differing step
must be such a tie on both sides. Qwen3-MoE can also flip an expert when two router logits
tie (one bf16 unit apart), which changes the token at once: `test_qwen3_moe_routing_tie` pins
the one such prompt met, and the prompts of the other tests meet none.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from disagg.config import ModelConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.model import decode_layers
from disagg.model.loading.registry import LoadedModel
from disagg.model.moe_routing import Router
from tests.disagg.conftest import hf_smollm2_dir
from tests.disagg.model.test_architectures_vs_hf import make_hf_model
from tests.disagg.model.test_deepseek_v3_vs_hf import make_hf_deepseek
from tests.disagg.model.test_precision import engine_config, our_prefill_logits
from tests.disagg.model.test_qwen3_moe_vs_hf import make_hf_qwen3_moe
from tests.disagg.model.test_smollm2_vs_hf import PROMPTS as SMOLLM2_PROMPTS
from tests.disagg.model.test_transformer_vs_hf import random_prompts

transformers = pytest.importorskip("transformers")

NUM_NEW_TOKENS = 12
TOLERANCE_EPS = 6.0
ARCHITECTURES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3"]
DTYPES = [torch.bfloat16, torch.float16]


class Checkpoint(NamedTuple):
    path: Path  # what transformers saved, in float32
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # the same weights in our names


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: ANN401 - a getter
    """`checkpoint(architecture)`: a random model of it saved by transformers, built once."""

    @functools.cache
    def get(architecture: str) -> Checkpoint:
        path = tmp_path_factory.mktemp(architecture)
        if architecture == "qwen3_moe":
            _, config, state_dict = make_hf_qwen3_moe(path, norm_topk_prob=True)
        elif architecture == "deepseek_v3":
            _, config, state_dict = make_hf_deepseek(path, 24, first_dense=1)
            path = path / "deepseek"
        else:
            hf_model, config, state_dict = make_hf_model(
                {"llama": "llama-llama3", "qwen3": "qwen3"}[architecture])
            hf_model.save_pretrained(path)
        return Checkpoint(path, config, state_dict)

    return get


@functools.cache
def hf_model(path: Path, dtype: torch.dtype) -> Any:  # noqa: ANN401 - a transformers model
    """transformers' own half-precision load of `path` (eager attention)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager").eval()


def tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    """How far two roundings of the same `dtype` logits may be apart (module docstring)."""
    return TOLERANCE_EPS * torch.finfo(dtype).eps * float(logits.abs().max())


def hf_prefill_logits(model: Any, prompt: list[int]) -> torch.Tensor:  # noqa: ANN401
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]


def hf_generate(model: Any, prompt: list[int], num_new_tokens: int = NUM_NEW_TOKENS,  # noqa: ANN401
                ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the raw logits ``[vocab_size]`` of each step."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float() for step in out.logits]


def our_generate(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 prompts: list[list[int]], dtype: torch.dtype, kv_layout: str,
                 num_new_tokens: int = NUM_NEW_TOKENS,
                 ) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Our greedy tokens of every prompt (served together), each with, per step, the
    logprobs of that step's 5 likeliest tokens."""
    engine = build_engine(engine_config(config, dtype, dtype, kv_layout), state_dict)
    params = SamplingParams(max_tokens=num_new_tokens, ignore_eos=True, logprobs=5)
    requests = engine.generate(prompts, params)
    engine.allocator.check_invariants(expect_all_free=True)
    return [(r.output_token_ids, [dict(step.top) for step in engine.chooser.logprobs(r)])
            for r in requests]


def assert_equal_or_tie(ours: list[int], our_top: list[dict[int, float]], theirs: list[int],
                        their_logits: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Equal tokens, or at the first step where they differ both sides see a tie: each side's
    logit for the other's token within `tolerance` of its own pick's (our logprobs differ by
    the same amounts as our logits)."""
    if ours == theirs:
        return
    step = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    ours_token, their_token = ours[step], theirs[step]
    logits = their_logits[step]
    tol = tolerance(dtype, logits)
    assert their_token in our_top[step], f"step {step}: {their_token} not in our top 5"
    our_gap = our_top[step][ours_token] - our_top[step][their_token]
    their_gap = float(logits[their_token] - logits[ours_token])
    assert our_gap <= tol, f"step {step}: ours prefers {ours_token} by {our_gap} > {tol}"
    assert their_gap <= tol, f"step {step}: transformers prefers {their_token} by {their_gap}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_tokens_match_hf(checkpoint: Any, architecture: str,  # noqa: ANN401
                                dtype: torch.dtype) -> None:
    """Three prompts served together decode transformers' tokens in the same dtype, or part
    at a rounding tie of the logits."""
    path, config, state_dict = checkpoint(architecture)
    prompts = random_prompts([20, 7, 13], seed=5)
    kv_layout = "NHD" if dtype == torch.bfloat16 else "HND"
    ours = our_generate(config, state_dict, prompts, dtype, kv_layout)
    for prompt, (tokens, top) in zip(prompts, ours, strict=True):
        theirs, their_logits = hf_generate(hf_model(path, dtype), prompt)
        assert_equal_or_tie(tokens, top, theirs, their_logits, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_prefill_logits_match_hf(checkpoint: Any, architecture: str,  # noqa: ANN401
                                 dtype: torch.dtype) -> None:
    """Every position's logits of a 24-token prefill, computed in `dtype`, lie within the
    tolerance of transformers' in the same dtype."""
    path, config, state_dict = checkpoint(architecture)
    prompt = random_prompts([24], seed=0)[0]
    ours = our_prefill_logits(config, state_dict, prompt, dtype, dtype)
    assert ours.dtype == dtype  # computed in it, not in float32 then rounded
    theirs = hf_prefill_logits(hf_model(path, dtype), prompt).float()
    assert float((ours.float() - theirs).abs().max()) <= tolerance(dtype, theirs)


def router_logits(model: torch.nn.Module, kind: type) -> list[torch.Tensor]:
    """Hooks `model`'s routers; returns the list each forward appends its logits to."""
    calls: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: Any) -> None:  # noqa: ANN401
        logits = out[0] if kind is not Router else F.linear(args[0], module.weight)
        calls.append(logits.detach().float().reshape(-1, logits.shape[-1]))

    for module in model.modules():
        if isinstance(module, kind):
            module.register_forward_hook(record)
    return calls


def test_qwen3_moe_routing_tie(checkpoint: Any,  # noqa: ANN401
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 prompt whose tokens part where no logits tie: at that very step the router
    ranks the 2nd and 3rd experts at most two bf16 units apart, and the two sides keep
    different ones (so the token differs by more than a tie). Everything before it routes
    alike. (Two units, not one: our attention runs SDPA's fused kernel, which accumulates in
    float32, where transformers' eager attention rounds its scores to bf16.)"""
    path, config, state_dict = checkpoint("qwen3_moe")
    # The hooks below see the router's module calls: the loop's. A decode step in one C call
    # has the loop's bits (tests/disagg/model/test_decode_layers.py) but calls no module.
    monkeypatch.setattr(decode_layers, "ENABLED", False)
    prompt = random_prompts([20, 7, 13, 30, 3, 11], seed=5)[4]
    engine = build_engine(engine_config(config, torch.bfloat16, torch.bfloat16), state_dict)
    ours_calls = router_logits(engine.model, Router)
    ours = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True)
                           )[0].output_token_ids
    reference = hf_model(path, torch.bfloat16)
    their_calls = router_logits(reference, type(reference.model.layers[0].mlp.gate))
    theirs, _ = hf_generate(reference, prompt, 16)
    step = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    assert config.moe is not None
    top_k = config.moe.num_experts_per_tok
    # One router call per step (call 0 is the prefill), one row per token of the call.
    chosen = [[[set(row.tolist()) for row in call.topk(top_k).indices] for call in calls]
              for calls in (ours_calls, their_calls)]
    assert chosen[0][:step] == chosen[1][:step]
    assert chosen[0][step] != chosen[1][step]
    for calls in (ours_calls[step], their_calls[step]):
        kth, next_best = calls[-1].topk(top_k + 1).values[-2:]  # the last (decode) row
        assert kth - next_best <= 2 * torch.finfo(torch.bfloat16).eps * float(kth)


@pytest.mark.slow  # PyTorch's one-row bf16 matmuls are ~20x float32's on this CPU: ~30 s
def test_smollm2_bf16_matches_hf(smollm2_model: LoadedModel, smollm2_gguf_path: Path,
                                 hf_smollm2_tokenizer: Any) -> None:  # noqa: ANN401
    """SmolLM2-135M at bf16, three reference prompts served together: transformers' bf16
    tokens, or a tie where they part (the first prompt parts at step 3, where both sides rank
    two tokens one bf16 unit apart); the first prompt's prefill logits within the tolerance."""
    reference = hf_model(hf_smollm2_dir(smollm2_gguf_path), torch.bfloat16)
    prompts = [hf_smollm2_tokenizer.encode(p, add_special_tokens=False)
               for p in SMOLLM2_PROMPTS[:3]]
    config, state_dict = smollm2_model.config, smollm2_model.state_dict
    ours = our_generate(config, state_dict, prompts, torch.bfloat16, "HND", num_new_tokens=8)
    for prompt, (tokens, top) in zip(prompts, ours, strict=True):
        theirs, their_logits = hf_generate(reference, prompt, 8)
        assert_equal_or_tie(tokens, top, theirs, their_logits, torch.bfloat16)
    logits = our_prefill_logits(config, state_dict, prompts[0], torch.bfloat16, torch.bfloat16)
    theirs = hf_prefill_logits(reference, prompts[0]).float()
    assert float((logits.float() - theirs).abs().max()) <= tolerance(torch.bfloat16, theirs)
