"""Text <-> token ids: a thin wrapper around the `tokenizers` library, plus streaming decode.

Built either from a GGUF file's vocabulary (byte-level BPE, as llama.cpp stores it) or from a
checkpoint's `tokenizer.json`. Not part of the serving path proper (S1): the engines only move
token ids; the CLI turns them into text. `StreamDecoder` prints text as tokens arrive without
cutting a UTF-8 character in half.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from disagg.errors import ModelLoadError

# llama.cpp token types (`tokenizer.ggml.token_type`).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# `tokenizer.ggml.pre` names whose pre-tokenizer we rebuild. llama.cpp's "smollm" (shared with
# starcoder, refact, ...) isolates every digit, then applies the GPT-2 split: the same as the
# `Sequence[Digits(individual), ByteLevel]` in SmolLM2's own tokenizer.json.
_GPT2_PRE = ("default", "gpt2")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell")


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_alphabet()


class Tokenizer:
    """Encode text to ids and back; knows the BOS id and the ids that end a generation."""

    def __init__(self, backend: Backend, bos_token_id: int | None,
                 eos_token_ids: Sequence[int]) -> None:
        self._backend = backend
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        self._byte_level = "ByteLevel" in repr(backend.decoder)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special markers such as `<|im_start|>` map to their own id.
        `add_special_tokens=False`: no BOS/EOS of the tokenizer's post-processor (a chat
        template writes its own)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; special tokens are kept unless `skip_special_tokens`."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as a Hugging Face `tokenizer.json`."""
        self._backend.save(str(path))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for, as OpenAI's logprobs report them: a byte-level token
        mapped back through GPT-2's byte alphabet, a `<0xNN>` fallback token as that byte, a
        SentencePiece token with its word marker as a space, an added token as its text."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._added_ids:
            return token.encode()
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        if self._byte_level and all(char in _BYTE_OF_CHAR for char in token):
            return bytes(_BYTE_OF_CHAR[char] for char in token)
        return token.replace("\u2581", " ").encode()

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None."""
        return self._backend.token_to_id(token)

    @staticmethod
    def from_file(path: str | Path, bos_token_id: int | None,
                  eos_token_ids: Sequence[int]) -> Tokenizer:
        """Load a Hugging Face `tokenizer.json`."""
        try:
            backend = Backend.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{path}: cannot read tokenizer: {error}") from error
        return Tokenizer(backend, bos_token_id, eos_token_ids)

    @staticmethod
    def from_gguf_vocab(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                        pre: str, bos_token_id: int | None, eos_token_ids: Sequence[int],
                        add_bos_token: bool = False) -> Tokenizer:
        """Byte-level BPE from GGUF metadata (`tokenizer.ggml.model == "gpt2"`).

        `tokens`, `merges` ("a b" strings) and `token_types` are the `tokenizer.ggml.*` arrays;
        `pre` is `tokenizer.ggml.pre`. Control tokens (type 3) become special added tokens, so
        they are matched whole in text and are skippable on decode.
        """
        vocab = {token: index for index, token in enumerate(tokens)}
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
        backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                     byte_fallback=False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        special = [AddedToken(token, special=True, normalized=False)
                   for token, kind in zip(tokens, token_types, strict=True)
                   if kind == TOKEN_TYPE_CONTROL and set(token) <= alphabet]
        user = [AddedToken(token, special=False, normalized=False)
                for token, kind in zip(tokens, token_types, strict=True)
                if kind == TOKEN_TYPE_USER_DEFINED]
        backend.add_special_tokens(special)
        backend.add_tokens(user)
        if add_bos_token:
            if bos_token_id is None:
                raise ModelLoadError("GGUF asks to add a BOS token but names no bos_token_id")
            bos = tokens[bos_token_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)])
        return Tokenizer(backend, bos_token_id, eos_token_ids)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    raise ModelLoadError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}: expected "
                         f"one of {sorted(_GPT2_PRE + _DIGITS_THEN_GPT2_PRE)}")


class StreamDecoder:
    """Turn ids arriving one by one into text, emitting each character exactly once.

    A byte-level token can end in the middle of a UTF-8 character; `tokenizers`' own
    `DecodeStream` holds such bytes back until a later token completes them (checked against
    our earlier hand-written window decoder on SmolLM2's byte-level vocabulary: same text, and
    the library keeps up with the tokenizer's decoders). `flush()` at the end returns what is
    still held back, so that the concatenation of all `push()` results and `flush()` equals
    `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0  # characters returned so far

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        text = self._stream.step(self._tokenizer._backend, token_id) or ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """Return the text still held back (an unfinished character decodes as U+FFFD)."""
        full = self._tokenizer.decode(self._ids, self._skip_special_tokens)
        rest, self._emitted = full[self._emitted:], len(full)
        return rest
