"""The tokenizer wrapper and streaming decode (`disagg.model.loading.tokenizer`).

Fast tests use a tiny byte-level vocabulary built in conftest; slow tests compare SmolLM2's
tokenizer, built from the GGUF metadata, with transformers' tokenizer built from the same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.errors import ModelLoadError
from disagg.model.loading.tokenizer import StreamDecoder, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\nend",
    "The year 2024 had 366 days; pi is 3.14159.",
    "naïve café, 中文字符, 日本語, 한국어",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
]
# Whitespace right before a digit: SmolLM2's own tokenizer (and llama.cpp's "smollm") isolate
# digits first, so the whitespace run stays whole; transformers' GGUF converter does not.
DIGIT_AFTER_SPACE = ["a\n\n1", "x  1", "Year 2024\n\n  7 days", "  42 "]

SETTINGS = settings(derandomize=True, deadline=None, max_examples=300)


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False
            ) -> list[str]:
    decoder = StreamDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
    return [decoder.push(token_id) for token_id in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tiny_tokenizer: Tokenizer, text: str) -> None:
    """Byte-level BPE decodes any encoded text back exactly."""
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_merges_and_special_tokens(tiny_tokenizer: Tokenizer) -> None:
    """Merged tokens are used; chat markers are one id each and skippable on decode."""
    the, cat = tiny_tokenizer.token_to_id("Ġthe"), tiny_tokenizer.token_to_id("Ġcat")
    assert tiny_tokenizer.encode("<|im_start|> the cat<|im_end|>") == [1, the, cat, 2]
    assert tiny_tokenizer.decode([1, the, cat, 2], skip_special_tokens=True) == " the cat"
    assert (tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_ids) == (1, (2,))
    assert tiny_tokenizer.vocab_size == 268


def test_digits_split_before_whitespace_grouping(tiny_tokenizer: Tokenizer) -> None:
    """The "smollm" pre-tokenizer keeps "\\n\\n" whole before a digit (plain GPT-2 would not)."""
    ids = tiny_tokenizer.encode("a\n\n12")
    assert ids == [tiny_tokenizer.token_to_id(t) for t in ["a", "ĊĊ", "1", "2"]]


def test_add_bos_token(tiny_gguf_vocab: dict[str, Any]) -> None:
    """`tokenizer.ggml.add_bos_token` prepends the BOS id on encode."""
    tokenizer = Tokenizer.from_gguf_vocab(**tiny_gguf_vocab, pre="gpt2", bos_token_id=1,
                                          eos_token_ids=[2], add_bos_token=True)
    assert tokenizer.encode("hi")[0] == 1
    assert len(tokenizer.encode("hi")) == 3


def test_unknown_pre_tokenizer_is_refused(tiny_gguf_vocab: dict[str, Any]) -> None:
    """An unsupported `tokenizer.ggml.pre` raises ModelLoadError naming it."""
    with pytest.raises(ModelLoadError, match="'chatglm-bpe'"):
        Tokenizer.from_gguf_vocab(**tiny_gguf_vocab, pre="chatglm-bpe", bos_token_id=1,
                                  eos_token_ids=[2])


def test_save_and_load_tokenizer_json(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    """A saved tokenizer.json loads back with identical encodings."""
    tiny_tokenizer.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json", 1, [2])
    assert all(loaded.encode(text) == tiny_tokenizer.encode(text) for text in TEXTS)


def test_bad_tokenizer_json_is_refused(tmp_path: Path) -> None:
    """A corrupt tokenizer.json raises ModelLoadError naming the file."""
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_file(tmp_path / "tokenizer.json", None, [])


def test_stream_never_emits_half_characters(tiny_tokenizer: Tokenizer) -> None:
    """Fed byte tokens of multi-byte characters, no piece holds U+FFFD and nothing repeats."""
    text = "中文 the cat 😀!"
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.token_to_id("ä¸") in ids  # a token ending inside "中"
    pieces = _stream(tiny_tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text
    assert pieces[0] == ""  # "ä¸" alone completes no character


def test_flush_returns_unfinished_character(tiny_tokenizer: Tokenizer) -> None:
    """Ids that stop inside a character are given back by flush, as decode shows them."""
    ids = [tiny_tokenizer.token_to_id("ä¸")]
    decoder = StreamDecoder(tiny_tokenizer)
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == tiny_tokenizer.decode(ids) == "\ufffd"


@SETTINGS
@given(ids=st.lists(st.integers(0, 267), max_size=40), skip=st.booleans())
def test_stream_equals_decode_tiny(tiny_tokenizer: Tokenizer, ids: list[int],
                                   skip: bool) -> None:
    """Pushing random ids one by one, then flushing, yields exactly decode(all ids)."""
    assert "".join(_stream(tiny_tokenizer, ids, skip)) == tiny_tokenizer.decode(ids, skip)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_matches_transformers(smollm2_tokenizer: Tokenizer, hf_smollm2_tokenizer: Any,
                                      text: str) -> None:
    """Same ids and same decode as transformers' tokenizer built from the same GGUF."""
    ids = smollm2_tokenizer.encode(text)
    assert ids == hf_smollm2_tokenizer(text)["input_ids"]
    assert smollm2_tokenizer.decode(ids) == hf_smollm2_tokenizer.decode(ids) == text


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS + DIGIT_AFTER_SPACE)
def test_smollm2_matches_its_tokenizer_json_pre_tokenizer(
        smollm2_tokenizer: Tokenizer, hf_smollm2_tokenizer: Any, text: str) -> None:
    """With SmolLM2's tokenizer.json pre-tokenizer (Digits, then ByteLevel) ids agree always."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    reference = Backend.from_str(hf_smollm2_tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    assert smollm2_tokenizer.encode(text) == reference.encode(text).ids


@pytest.mark.slow
def test_smollm2_special_ids(smollm2_tokenizer: Tokenizer) -> None:
    """BOS is <|im_start|> (1); generation ends on <|im_end|> (2), as transformers' config says."""
    assert smollm2_tokenizer.vocab_size == 49152
    assert smollm2_tokenizer.bos_token_id == smollm2_tokenizer.token_to_id("<|im_start|>") == 1
    assert smollm2_tokenizer.eos_token_ids == (smollm2_tokenizer.token_to_id("<|im_end|>"),)


@pytest.mark.slow
@SETTINGS
@given(ids=st.lists(st.integers(0, 49151), max_size=40))
def test_smollm2_decode_and_stream(smollm2_tokenizer: Tokenizer, hf_smollm2_tokenizer: Any,
                                   ids: list[int]) -> None:
    """On random SmolLM2 ids: our decode equals transformers', and streaming equals decode."""
    assert smollm2_tokenizer.decode(ids) == hf_smollm2_tokenizer.decode(ids)
    assert "".join(_stream(smollm2_tokenizer, ids)) == smollm2_tokenizer.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_spell_the_text(tiny_tokenizer: Tokenizer, text: str) -> None:
    """Each id's bytes (what OpenAI's logprobs report), joined, are the text's UTF-8, even
    where one token ends in the middle of a character."""
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tiny_tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_a_sentencepiece_vocabulary() -> None:
    """Word markers are spaces and `<0xNN>` fallback tokens are their byte."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "\u2581hi": 1, "<0xC3>": 2, "<0xA9>": 3, "\u2581": 4}
    backend = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    tokenizer = Tokenizer(backend, None, [])
    assert [tokenizer.token_bytes(i) for i in (1, 2, 3, 4)] == [b" hi", b"\xc3", b"\xa9", b" "]
