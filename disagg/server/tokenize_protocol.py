"""The request bodies of `POST /tokenize` and `POST /detokenize`, validated, in vLLM's shapes:
tokenize takes a text `prompt` or chat `messages`, detokenize takes `tokens`.

`protocol.parse_body` reads them like the completions bodies, so the same JSON checks and 400s
apply. As there, vLLM's fields that we do not implement are accepted only at the value that
means what we do (`add_special_tokens`, `return_token_strs`), and unknown fields are ignored.
The routes that answer them are in `utility_routes.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from disagg.server.errors import InvalidRequest
from disagg.server.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: exactly one of `prompt` (tokenized as /v1/completions does) and
    `messages` (rendered and tokenized as /v1/chat/completions does)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True  # with messages, as in chat completions
    allow_special_tokens: bool = False  # with messages, as in chat completions
    # vLLM's: a prompt gets the tokenizer's BOS/EOS, messages only what the template writes.
    add_special_tokens: bool | None = None
    return_token_strs: Literal[False] | None = None

    def check_supported(self) -> None:
        """A 400 unless exactly one input is given, and `add_special_tokens` (when sent)
        says what that input gets."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("send either prompt or messages (one of the two)",
                                 "prompt" if self.prompt is None else "messages")
        chat = self.messages is not None
        if self.add_special_tokens is not None and self.add_special_tokens == chat:
            raise InvalidRequest(f"add_special_tokens={self.add_special_tokens} is not "
                                 "supported: a prompt is tokenized with the tokenizer's special "
                                 "tokens and messages without, as the completions routes do; "
                                 "leave it unset", "add_special_tokens")


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: the text of `tokens`."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        """Nothing beyond the types (the vocabulary check needs the model: the route's)."""


REQUEST_MODELS: list[type[BaseModel]] = [TokenizeRequest, DetokenizeRequest]
