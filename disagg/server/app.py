"""The OpenAI-compatible HTTP API of a cluster: completions, chat completions, models, health
and metrics (FastAPI).

Handlers read the body within its limit, validate it (`protocol.py`), turn the prompt into
token ids (chat: with the tools offered, `tool_prompt.py`), fit what the decoder is asked for
(`request_params.py`; a grammar is compiled once here so that a bad one is a 400) and answer
through `serving.py`. Parsing, tokenizing, rendering and compiling run in a small thread pool,
after checks that bound their cost, so the event loop keeps answering everyone else (X5b).
The API key check and the utility routes (tokenize, detokenize, version) are installed from
`api_key.py` and `utility_routes.py`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from disagg.config import ModelConfig
from disagg.engine.guide_spec import Guide, GuideKind
from disagg.engine.request import SamplingParams
from disagg.errors import GuideError
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server import responses
from disagg.server.api_key import install_api_key
from disagg.server.chat_template import ChatTemplate, require_chat_template
from disagg.server.choices import Shape
from disagg.server.cluster_client import ClusterClient
from disagg.server.errors import APIError, InvalidRequest, ModelNotFound
from disagg.server.generation import Timings
from disagg.server.http_config import HTTPConfig
from disagg.server.limits import check_prompt_chars, max_token_chars, read_body
from disagg.server.metrics import ServerMetrics
from disagg.server.openapi import install_openapi, request_body
from disagg.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_body,
)
from disagg.server.request_params import Budget, guide_param, sampling_params
from disagg.server.serving import serve
from disagg.server.tokenize_protocol import REQUEST_MODELS as UTILITY_REQUESTS
from disagg.server.tool_prompt import (
    call_guide_spec,
    render_tool_messages,
    shown_tools,
)
from disagg.server.tracing import TracingMiddleware
from disagg.server.utility_routes import install_utility_routes

if TYPE_CHECKING:
    from disagg.engine.guided import GuideCompiler

T = TypeVar("T")
# Threads that parse bodies, tokenize and render templates: a few, so that a burst of big
# prompts queues here instead of taking every core from the event loop and the engines.
WORK_THREADS = 4


@dataclass
class FrontDoor:
    """What the HTTP layer serves: one model, through one cluster."""

    model_name: str
    model: ModelConfig
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    client: ClusterClient
    metrics: ServerMetrics
    health: Callable[[], tuple[bool, dict[str, Any]]]  # (all nodes answer, the body)
    max_request_tokens: int | None = None  # a decoder's whole cache, when known
    guides: GuideCompiler | None = None  # compiles grammars to check them (needs a tokenizer)
    created: int = field(default_factory=lambda: int(time.time()))
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        WORK_THREADS, "front-door-work"))
    _chars_per_token: int | None = field(default=None, init=False, repr=False)

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:  # noqa: ANN401
        """`work(*args)` in the front door's threads; its exceptions are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, work, *args)

    @property
    def context_tokens(self) -> int:
        """The most tokens one request can hold: the model's context, or a decoder's cache."""
        context = self.model.max_position_embeddings
        return context if self.max_request_tokens is None else min(context,
                                                                    self.max_request_tokens)

    def check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context at any tokenization, before tokenizing it
        (the bound on characters per token is read from the vocabulary once, here in a
        worker thread)."""
        if self.tokenizer is None:
            return
        if self._chars_per_token is None:
            self._chars_per_token = max_token_chars(self.tokenizer)
        check_prompt_chars(num_chars, self.context_tokens, self._chars_per_token, param)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt (worker thread: tokenizing is the slow part)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest(f"model {self.model_name!r} has no tokenizer: send the "
                                     "prompt as a list of token ids", "prompt")
            self.check_text_length(len(prompt), "prompt")
            return self.tokenizer.encode(prompt)
        context = self.model.max_position_embeddings  # the cache's own check is `sampling`'s
        if len(prompt) >= context:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; the model's context is "
                                 f"{context}", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary of "
                                 f"{self.model.vocab_size}", "prompt")
        return prompt

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        """Token ids of a chat prompt: the template rendered (with the tools it is offered,
        `tool_prompt.py`), then tokenized (worker thread). The messages' text is a lower bound
        on the prompt's (a template writes each message), so it is checked against the
        context first."""
        template = require_chat_template(self.model_name, self.chat_template)
        assert self.tokenizer is not None  # a template comes with its tokenizer
        self.check_text_length(sum(_text_length(m.content) for m in body.messages), "messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        variables: dict[str, Any] = {}
        if body.tools:
            messages, variables = render_tool_messages(messages, body.tools, template.source,
                                                       body.tool_choice)
        return template.render_ids(messages, self.tokenizer, body.add_generation_prompt,
                                   body.allow_special_tokens, **variables)

    def params(self, body: SamplingFields, prompt_len: int, max_tokens: int | None,
               param: str, logprobs: int | None,
               forced_call: dict[str, Any] | None = None) -> SamplingParams:
        """What the decoder is asked for (worker thread: the grammar is built and compiled here
        once, to refuse one the library cannot compile with a 400 before anything is
        submitted). `forced_call`: the tagged-JSON spec of a tool call the request forces."""
        guide = body.guide()
        if forced_call is not None:
            if guide is not None:
                raise InvalidRequest(f"tool_choice {getattr(body, 'tool_choice', None)!r} "
                                     "forces a tool call, so the output cannot also follow "
                                     "another format", guide_param(body))
            guide = Guide(GuideKind.TAGGED_JSON, json.dumps(forced_call))
        where = guide_param(body) or "tool_choice"
        budget = Budget(self.model.max_position_embeddings, self.max_request_tokens)
        params = sampling_params(body, budget.max_tokens(prompt_len, max_tokens, param,
                                                         body.n or 1),
                                 self.model.vocab_size, logprobs, guide)
        if guide is not None:
            if body.ignore_eos:
                raise InvalidRequest("ignore_eos cannot be combined with structured output",
                                     "ignore_eos")
            if self.guides is None:
                raise InvalidRequest(f"model {self.model_name!r} has no tokenizer: structured "
                                     "output needs one", where)
            try:
                self.guides.check(guide)
            except GuideError as error:
                raise InvalidRequest(str(error), where) from None
        return params


def _text_length(content: str | list[dict[str, Any]] | None) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text") or "") for part in content or [] if isinstance(part, dict))


def build_app(door: FrontDoor, http: HTTPConfig | None = None) -> FastAPI:
    """The API over `door`; `http` gives its body limit and API key (the rest of `HTTPConfig`
    is the HTTP server's: `http_server.py`)."""
    http = http or HTTPConfig()
    max_body_bytes = http.max_body_bytes
    app = FastAPI(title="disagg", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, *UTILITY_REQUESTS])
    install_api_key(app, http.api_key)
    # Outermost: a request's span covers the API key check and a streamed answer's last byte.
    app.add_middleware(TracingMiddleware, tracer=door.client.tracer)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        body = APIError(str(error.detail)).body()
        return JSONResponse(body, status_code=error.status_code)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        timings = Timings()
        raw = await read_body(request, max_body_bytes)
        body = await door.off_loop(parse_body, raw, CompletionRequest)
        check_model(door, body.model)
        stops = body.stop_strings()
        prompt = await door.off_loop(door.prompt_ids, body.single_prompt())
        params = await door.off_loop(door.params, body, len(prompt), body.max_tokens,
                                     "max_tokens", body.logprobs)
        shape = Shape(chat=False, tokenizer=door.tokenizer, logprobs=body.logprobs is not None)
        return await serve(door, request, body, prompt, stops, params, timings, shape)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        timings = Timings()
        raw = await read_body(request, max_body_bytes)
        body = await door.off_loop(parse_body, raw, ChatCompletionRequest)
        check_model(door, body.model)
        stops = body.stop_strings()
        prompt = await door.off_loop(door.chat_ids, body)
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        params = await door.off_loop(door.params, body, len(prompt), body.token_budget(),
                                     param, body.num_logprobs(),
                                     call_guide_spec(body.tools, body.tool_choice))
        shape = Shape(chat=True, tokenizer=door.tokenizer, logprobs=bool(body.logprobs),
                      tools=bool(shown_tools(body.tools, body.tool_choice)),
                      one_call=body.parallel_tool_calls is False)
        return await serve(door, request, body, prompt, stops, params, timings, shape)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(responses.model_list(door.model_name, door.created))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = await asyncio.to_thread(door.health)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await asyncio.to_thread(generate_latest, door.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/targets")
    async def metrics_targets() -> JSONResponse:
        # Prometheus' http_sd_configs reads this list and scrapes each node itself.
        return JSONResponse(door.metrics.targets())

    install_utility_routes(app, door, max_body_bytes)  # /tokenize, /detokenize, /version
    return app


def check_model(door: FrontDoor, model: str) -> None:
    if model != door.model_name:
        raise ModelNotFound(model)
