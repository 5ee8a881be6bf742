"""`load_tokenizer("smollm2-135m")` reads no weights (`registry`, `gguf_cache`, `gguf`): from
the model cache entry's metadata and tokenizer files when there is one, else from the GGUF's
metadata; never a tensor dequantized, never the entry's weights file. A tiny GGUF stands in
for SmolLM2's (the real one takes seconds to open).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest

from disagg.model.loading import gguf_cache, registry
from disagg.model.loading.gguf_cache import CACHE_ENV
from disagg.model.loading.registry import ModelTokenizer, load_model, load_tokenizer
from tests.disagg.model.loading.test_gguf import (  # noqa: F401 (the fixture)
    _add,
    _write_gguf,
    tiny_hf_weights,
)

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
TEXT = "<|im_start|> the cat sat"


@pytest.fixture
def smollm2_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 tiny_hf_weights: Callable[..., dict],  # noqa: F811 (the imported fixture)
                 tiny_gguf_vocab: dict[str, Any]) -> Path:
    """A tiny GGUF found as SmolLM2's, with an empty model cache of its own."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "smollm2.gguf", tiny_hf_weights(), tiny_gguf_vocab,
                       extra=_add("tokenizer.chat_template", TEMPLATE))
    monkeypatch.setattr(registry, "find_smollm2_gguf", lambda: path)
    return path


def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a GGUF tensor is dequantized or a cache entry's weights are read."""
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("weights were read")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    monkeypatch.setattr(gguf_cache, "load_file", refuse)


def same_as_loaded(described: ModelTokenizer) -> None:
    loaded = load_model("smollm2-135m")
    assert described.config == loaded.config
    assert described.chat_template == loaded.chat_template == TEMPLATE
    assert described.tokenizer is not None
    assert loaded.tokenizer is not None
    assert described.tokenizer.encode(TEXT) == loaded.tokenizer.encode(TEXT)
    assert described.tokenizer.eos_token_ids == loaded.tokenizer.eos_token_ids


def test_without_a_cache_entry_the_gguf_metadata_is_read(
        smollm2_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing cached: config, tokenizer and template come from the GGUF's metadata alone,
    equal to what the full load gives."""
    with pytest.MonkeyPatch.context() as patch:
        no_weights(patch)
        described = load_tokenizer("smollm2-135m")
    same_as_loaded(described)


def test_a_cache_entry_is_read_without_its_weights(
        smollm2_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a node loaded the model, the front door reads the entry's small files only: not
    the weights, not even the GGUF."""
    load_model("smollm2-135m")  # writes the entry
    with pytest.MonkeyPatch.context() as patch:
        no_weights(patch)
        patch.setattr(gguf, "GGUFReader", lambda *_: pytest.fail("the GGUF was opened"))
        described = load_tokenizer("smollm2-135m")
    same_as_loaded(described)
