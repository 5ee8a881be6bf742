"""Every architecture through our own loader: a random transformers model, saved by
`save_pretrained` as sharded safetensors, read back by `load_model` (config.json parsed by
`hf_config.py`, the shards by `hf.py`), decodes transformers' own greedy tokens (S3b, S9).

The model-level tests build our config by hand to test the modules; this one checks that what
transformers writes to disk is what the loader makes of it, for each of the six architectures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disagg.model.loading.registry import load_model
from tests.disagg.model.test_architectures_vs_hf import make_hf_model, our_greedy
from tests.disagg.model.test_deepseek_v3_vs_hf import make_hf_deepseek
from tests.disagg.model.test_qwen3_moe_vs_hf import make_hf_qwen3_moe

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
SHARD = "40KB"  # several safetensors files and an index, for models of a few hundred KB


def hf_model_of(case: str, tmp_path: Path) -> tuple[object, str]:
    """The transformers model of `case` and the architecture our loader must read."""
    if case == "qwen3_moe":
        return make_hf_qwen3_moe(tmp_path, norm_topk_prob=True)[0], case
    if case == "deepseek_v3":
        return make_hf_deepseek(tmp_path, q_lora_rank=24, first_dense=1)[0], case
    return make_hf_model(case)[0], case.split("-")[0]


def hf_greedy(hf_model: object, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(  # type: ignore[attr-defined]
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", [
    "qwen2", "qwen3_moe", "deepseek_v3",  # the inner loop: biases, experts by name, MLA
    *(pytest.param(case, marks=pytest.mark.slow) for case in ("llama-llama3", "mistral", "qwen3")),
])
def test_saved_checkpoint_loads_and_decodes_like_transformers(tmp_path: Path, case: str) -> None:
    hf_model, architecture = hf_model_of(case, tmp_path)
    directory = tmp_path / "checkpoint"
    hf_model.save_pretrained(directory, max_shard_size=SHARD)  # type: ignore[attr-defined]
    assert (directory / "model.safetensors.index.json").is_file()
    loaded = load_model(str(directory))
    assert loaded.config.architecture == architecture
    prompt = torch.randint(1, loaded.config.vocab_size, (17,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    ours = our_greedy(loaded.config, loaded.state_dict, [prompt], "HND", page_size=5,
                      chunk_size=6)
    assert [tokens[:NEW_TOKENS] for tokens in ours] == [hf_greedy(hf_model, prompt)]
