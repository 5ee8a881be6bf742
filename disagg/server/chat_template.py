"""Chat templates: turn an OpenAI `messages` list into the model's prompt text and token ids.

The template is the model's own Jinja source (GGUF metadata or Hugging Face tokenizer files,
read by `disagg.model.loading`). It runs in jinja2's immutable sandbox under the conventions
transformers' `apply_chat_template` uses, so a prompt matches the model's training format token
for token: `trim_blocks` and `lstrip_blocks`, a `raise_exception` function, a `tojson` filter
that keeps non-ASCII text, `strftime_now`, and the variables `messages`,
`add_generation_prompt`, `bos_token` and `eos_token`. The rendered text is tokenised without
the tokenizer's own BOS/EOS additions (the template writes those itself), and special markers
such as `<|im_start|>` that the template wrote become their single ids, while the same text
inside a message stays plain text unless asked otherwise (`render_ids`, `plain_text.py`:
X5b). Messages are checked before rendering; every refusal is a `ChatTemplateError` (HTTP 400)
naming the offending field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from disagg.errors import ModelLoadError
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server.errors import ChatTemplateError
from disagg.server.plain_text import free_sentinels, plain_text_encoder, unwrap

ROLES = ("system", "developer", "user", "assistant", "tool")
# Text parts of one message are joined with a newline, so that they stay apart in the prompt.
PART_SEPARATOR = "\n"


class ChatTemplate:
    """One model's chat template, compiled once; `render` then `encode` for each request."""

    def __init__(self, template: str, bos_token: str | None, eos_token: str | None) -> None:
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as error:
            raise ModelLoadError(f"the chat template does not compile: line {error.lineno}: "
                                 f"{error.message}") from error

    @classmethod
    def for_tokenizer(cls, template: str, tokenizer: Tokenizer) -> ChatTemplate:
        """`template` with `bos_token`/`eos_token` spelled from the tokenizer's BOS and 1st EOS."""
        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        return cls(template, _spelling(tokenizer, tokenizer.bos_token_id),
                   _spelling(tokenizer, eos))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text of `messages`; `variables` (e.g. `tools`) are passed to the template.

        `add_generation_prompt` appends the header that opens the assistant's turn.
        """
        return self._render(validate_messages(messages), add_generation_prompt, **variables)

    def _render(self, chat: list[dict[str, Any]], add_generation_prompt: bool,
                **variables: Any) -> str:
        context: dict[str, Any] = {}
        if self.bos_token is not None:
            context["bos_token"] = self.bos_token
        if self.eos_token is not None:
            context["eos_token"] = self.eos_token
        context |= variables
        try:
            return self._compiled.render(messages=chat,
                                         add_generation_prompt=add_generation_prompt, **context)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError) as error:
            raise ChatTemplateError(f"the model's chat template cannot render these messages: "
                                    f"{error}", "messages") from error

    @staticmethod
    def encode(text: str, tokenizer: Tokenizer) -> list[int]:
        """Token ids of rendered `text`: special markers matched whole, no BOS/EOS added.

        Like transformers (`apply_chat_template` encodes with `add_special_tokens=False`): the
        template already wrote any BOS it wants, so the tokenizer's post-processor must not
        add a second one. `Tokenizer.encode` always adds them, hence its backend here.
        """
        return tokenizer.encode(text, add_special_tokens=False)

    def render_ids(self, messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer,
                   add_generation_prompt: bool = True,
                   allow_special_tokens: bool = False, **variables: Any) -> list[int]:
        """The prompt's ids: `encode(render(...))`, except that special-token text inside a
        message's content stays plain text unless `allow_special_tokens`; `variables` (e.g.
        `tools`) are passed to the template.

        To know which characters of the prompt came from content, the messages are rendered
        a second time with each content wrapped in two unused private-use characters. If
        removing those gives back the same prompt, the wrapped spans are exact (even where the
        template transformed the content). If not (the template inspects the content), the
        content cannot be told apart from the template's own text: that is harmless unless a
        message spells a special token, and then the request is refused rather than read with
        real special tokens.
        """
        chat = validate_messages(messages)
        text = self._render(chat, add_generation_prompt, **variables)
        if allow_special_tokens:
            return self.encode(text, tokenizer)
        encoder = plain_text_encoder(tokenizer)
        has_text = [i for i, m in enumerate(chat) if isinstance(m.get("content"), str)]
        begin, end = free_sentinels([text, *(chat[i]["content"] for i in has_text)])
        wrapped = [dict(m, content=f"{begin}{m['content']}{end}") if i in has_text else m
                   for i, m in enumerate(chat)]
        try:
            unwrapped, spans = unwrap(self._render(wrapped, add_generation_prompt, **variables),
                                      begin, end)
        except ChatTemplateError:
            unwrapped, spans = "", []  # the template refused the wrapped content: inexact
        if unwrapped != text:
            spelled = [i for i in has_text if encoder.contains_special(chat[i]["content"])]
            if not spelled:
                return self.encode(text, tokenizer)  # nothing to keep plain: the same ids
            field = f"messages[{spelled[0]}].content"
            raise ChatTemplateError(f"{field} spells a special token, and the model's chat "
                                    "template rewrites the message, so it cannot be kept as "
                                    "plain text", field)
        return encoder.encode(text, spans)


def require_chat_template(model_name: str, template: ChatTemplate | None) -> ChatTemplate:
    """`template`, or a `ChatTemplateError` saying the model cannot chat."""
    if template is None:
        raise ChatTemplateError(f"model {model_name!r} has no chat template: send a prompt to "
                                "/v1/completions instead", "messages")
    return template


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Plain-dict copies of `messages` for a template, or a `ChatTemplateError` naming the field.

    Each message needs a `role` among `ROLES` and a `content` that is a string or a list of
    `{"type": "text", "text": ...}` parts (joined with `PART_SEPARATOR`); only an assistant
    message carrying `tool_calls` may omit it. Fields whose value is None are dropped, as
    transformers does, so that templates see them as undefined; other fields pass through.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise _error("messages", "must be a list of message objects")
    if not messages:
        raise _error("messages", "must contain at least one message")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: object, field: str) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise _error(field, "must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _error(f"{field}.role", f"must be one of {', '.join(ROLES)} (got {role!r})")
    plain = {key: value for key, value in message.items() if value is not None}
    content = message.get("content")
    if content is not None:
        plain["content"] = _content(content, f"{field}.content")
    elif role != "assistant" or message.get("tool_calls") is None:
        raise _error(f"{field}.content", "is missing (only an assistant message with "
                     "tool_calls may omit it)")
    return plain


def _content(content: object, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _error(field, f"must be a string or a list of text parts (got "
                            f"{type(content).__name__})")
    texts = []
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        if not isinstance(part, Mapping):
            raise _error(where, "must be an object {'type': 'text', 'text': ...}")
        if part.get("type") != "text":
            raise _error(f"{where}.type", f"is {part.get('type')!r}; only 'text' content parts "
                                          "are supported")
        if not isinstance(part.get("text"), str):
            raise _error(f"{where}.text", "must be a string")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


def _error(field: str, problem: str) -> ChatTemplateError:
    return ChatTemplateError(f"{field} {problem}", field)


def _spelling(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.decode([token_id])


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the model's chat template refused these messages: {message}",
                            "messages")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own `tojson` escapes <, >, & and ' for HTML; prompts want the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, which some templates wrap around assistant text
    (transformers uses it for training masks): here it renders just its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
