"""The gateway app: one URL for Claude Code, Codex and OpenAI clients, in front of engines or SGLang.

A request's path (`_serve`):

    body -> API adapter parse (canonical `Conversation`) -> model check -> session identity
      -> chat template prompt -> token ids -> placement (sticky session, least loaded, failover)
      -> backend /generate stream -> OutputParser (text, tool calls, stop strings) -> adapter
      response or SSE -> per-session stats (hit rate, append ratio) and metrics

Errors are answered in the calling API's own shape: bad input 400, unknown model 404, oversized body
413, bad key 401; a backend that is down before any output is replaced by another (the client never
sees it), one that fails mid-stream ends the stream with the API's error event. `--max-output-tokens`
caps what a request may generate; hitting it is reported as the API's max-tokens stop.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.apis import AnthropicMessages, Api, OpenAIChat, OpenAIResponses
from gateway.backend_client import BackendClient, BackendError, BackendUnavailable
from gateway.conversation import Conversation, Finish, OutputEvent, TextDelta, ToolCallStart, Usage
from gateway.metrics import GatewayMetrics
from gateway.output_parser import OutputParser
from gateway.prompt import ChatTemplate, render_prompt
from gateway.session_stats import SessionRegistry
from gateway.sessions import identify
from routing.placement import NoBackendAvailable, Placement


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    backends: tuple[str, ...]
    """Base URLs of engines or SGLang servers speaking SGLang's native API."""
    served_model: str = "loom"
    """The model name clients use; `model_aliases` are accepted too."""
    model_aliases: tuple[str, ...] = ()
    accept_any_model: bool = False
    """Serve every model name (e.g. Claude Code's own) with the one model."""
    tool_format: str = "hermes"
    max_output_tokens: int = 1024
    api_keys: tuple[str, ...] = ()
    """Accepted keys (x-api-key or Bearer); empty: no authentication."""
    max_body_bytes: int = 32 * 1024 * 1024
    max_sessions: int = 1000
    request_timeout_s: float = 600.0
    health_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("at least one backend URL is needed")
        if self.max_output_tokens < 1 or self.max_body_bytes < 1 or self.max_sessions < 1:
            raise ValueError("max_output_tokens, max_body_bytes and max_sessions must be positive")


class Tokenizer(ChatTemplate, Protocol):
    @property
    def all_special_tokens(self) -> list[str]: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class HTTPFailure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(slots=True)
class _Turn:
    """One request's results, collected while it streams."""

    events: list[OutputEvent] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    ttft_s: float | None = None


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, http: httpx.AsyncClient) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.placement = Placement(list(config.backends))
        self.clients = {url: BackendClient(url, http, config.request_timeout_s) for url in config.backends}
        self.sessions = SessionRegistry(config.max_sessions)
        self.metrics = GatewayMetrics(self.sessions, self.placement)

    ##### Request path #####

    async def handle(self, api: Api, request: Request) -> Response:
        started = time.perf_counter()
        try:
            self._authenticate(request.headers)
            body = await self._body(request)
            conversation = self._parse(api, body, request.headers)
            return await self._serve(api, body, conversation, request.headers, started)
        except BackendError as exc:
            return self._failure(api, HTTPFailure(exc.status, exc.message))
        except HTTPFailure as failure:
            return self._failure(api, failure)

    def _failure(self, api: Api, failure: HTTPFailure) -> Response:
        self.metrics.requests.labels(api.name, str(failure.status)).inc()
        return JSONResponse(api.error(failure.status, failure.message), status_code=failure.status)

    def _authenticate(self, headers: Mapping[str, str]) -> None:
        if not self.config.api_keys:
            return
        given = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
        if given not in self.config.api_keys:
            raise HTTPFailure(401, "invalid or missing API key (x-api-key or Authorization: Bearer)")

    async def _body(self, request: Request) -> Any:
        raw = await request.body()
        if len(raw) > self.config.max_body_bytes:
            raise HTTPFailure(413, f"request body of {len(raw)} bytes exceeds {self.config.max_body_bytes}")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPFailure(400, f"request body is not valid JSON: {exc}") from exc

    def _parse(self, api: Api, body: Any, headers: Mapping[str, str]) -> Conversation:
        try:
            conversation = api.parse(body, headers)
        except api.invalid_request as exc:
            raise HTTPFailure(400, str(exc)) from exc
        known = {self.config.served_model, *self.config.model_aliases}
        if not self.config.accept_any_model and conversation.model not in known:
            raise HTTPFailure(
                404, f"unknown model {conversation.model!r}; this gateway serves {sorted(known)}"
            )
        return conversation

    async def _serve(
        self, api: Api, body: Any, conversation: Conversation, headers: Mapping[str, str], started: float
    ) -> Response:
        session = identify(headers, conversation).key
        prompt_text = render_prompt(conversation, self.tokenizer)
        prompt = self._tokenize(session, prompt_text)
        cap = self.config.max_output_tokens
        max_new = min(conversation.max_output_tokens or cap, cap)
        sampling: dict[str, Any] = {"max_new_tokens": max_new}
        for name, value in (("temperature", conversation.temperature), ("top_p", conversation.top_p),
                            ("top_k", conversation.top_k)):  # fmt: skip
            if value is not None:
                sampling[name] = value
        parser = OutputParser(
            self.config.tool_format,
            stop=conversation.stop,
            tool_names=[t.name for t in conversation.tools] if conversation.tool_choice != "none" else [],
        )
        turn = _Turn()
        turn.meta["_prompt_text"] = prompt_text
        generation = self._generate(session, prompt, sampling, parser, turn, started)
        if conversation.stream:
            first = await self._first(generation)
            stream = self._stream(
                api, body, conversation.model, first, generation, turn, prompt, session, api.name
            )
            return StreamingResponse(stream, media_type="text/event-stream")
        async for event in generation:
            turn.events.append(event)
        self._record(api.name, session, prompt, turn, started)
        return JSONResponse(api.response(turn.events, conversation.model))

    async def _first(self, generation: AsyncIterator[OutputEvent]) -> OutputEvent | None:
        """Wait for the first event before answering, so that errors before any output are plain HTTP."""
        try:
            return await generation.__anext__()
        except StopAsyncIteration:
            return None

    async def _stream(
        self,
        api: Api,
        body: Any,
        model: str,
        first: OutputEvent | None,
        generation: AsyncIterator[OutputEvent],
        turn: _Turn,
        prompt: list[int],
        session: str,
        api_name: str,
    ) -> AsyncIterator[str]:
        renderer = api.stream(body, model)
        for frame in renderer.start(len(prompt), int(turn.meta.get("cached_tokens", 0))):
            yield frame
        try:
            if first is not None:
                turn.events.append(first)
                for frame in renderer.feed(first):
                    yield frame
            async for event in generation:
                turn.events.append(event)
                for frame in renderer.feed(event):
                    yield frame
        except BackendError as exc:
            for frame in renderer.fail(exc.message):
                yield frame
            return
        self._record(api_name, session, prompt, turn, turn.meta.get("_started", time.perf_counter()))

    async def _generate(
        self,
        session: str,
        prompt: list[int],
        sampling: dict[str, Any],
        parser: OutputParser,
        turn: _Turn,
        started: float,
    ) -> AsyncIterator[OutputEvent]:
        turn.meta["_started"] = started
        tried: set[str] = set()
        while True:
            try:
                backend = self.placement.choose(session, frozenset(tried))
            except NoBackendAvailable as exc:
                raise HTTPFailure(503, "no backend is available; retry shortly") from exc
            tried.add(backend)
            self.placement.started(backend)
            try:
                async for event in self._from_backend(backend, prompt, sampling, parser, turn, started):
                    yield event
                return
            except BackendUnavailable:
                self.placement.mark_down(backend)
                if turn.output_ids:
                    raise
            finally:
                self.placement.finished(backend)

    async def _from_backend(
        self,
        backend: str,
        prompt: list[int],
        sampling: dict[str, Any],
        parser: OutputParser,
        turn: _Turn,
        started: float,
    ) -> AsyncIterator[OutputEvent]:
        turn.meta["backend"] = backend
        rid = f"loom-{uuid.uuid4().hex}"
        stream = self.clients[backend].stream(prompt, sampling, rid)
        try:
            async for increment in stream:
                if turn.ttft_s is None:
                    turn.ttft_s = time.perf_counter() - started
                turn.output_ids += increment.token_ids
                turn.meta.update(increment.meta_info)
                for event in parser.feed(increment.text):
                    yield event
                if parser.stopped:
                    break
        finally:
            await stream.aclose()
        for event in parser.finish():
            yield event
        yield self._finish(parser, turn, len(prompt))

    def _finish(self, parser: OutputParser, turn: _Turn, prompt_tokens: int) -> Finish:
        usage = Usage(prompt_tokens, len(turn.output_ids), int(turn.meta.get("cached_tokens", 0)))
        if parser.stopped:
            return Finish("stop_sequence", usage, parser.stopped)
        if any(isinstance(e, ToolCallStart) for e in turn.events):
            return Finish("tool_calls", usage)
        reason = turn.meta.get("finish_reason") or {}
        return Finish("length" if reason.get("type") == "length" else "stop", usage)

    def _tokenize(self, session: str, text: str) -> list[int]:
        """Token ids of the prompt: the previous turn's own ids (its prompt and what the model generated)
        when `text` resends that turn unchanged, plus the rest from a special token on; otherwise a full
        encode. Reusing the generated ids keeps each turn an exact extension of the last one even when
        the reply's text would tokenize differently; splicing only before a special token keeps the
        rest's tokenization independent of what came before (special tokens split the input)."""
        stats = self.sessions.get(session)
        if stats is not None and stats.last_text is not None and text.startswith(stats.last_text):
            rest = text[len(stats.last_text) :]
            if any(rest.startswith(special) for special in self.tokenizer.all_special_tokens):
                return [*stats.last_ids, *self.tokenizer.encode(rest, add_special_tokens=False)]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _record(self, api: str, session: str, prompt: list[int], turn: _Turn, started: float) -> None:
        cached = int(turn.meta.get("cached_tokens", 0))
        stats = self.sessions.record(
            session, api, turn.meta.get("backend", ""), prompt, turn.output_ids, cached, turn.ttft_s
        )
        stats.last_text, stats.last_ids = self._resendable(prompt, turn)
        self.metrics.observe(api, prompt, turn.output_ids, cached, turn.ttft_s, time.perf_counter() - started)

    def _resendable(self, prompt: list[int], turn: _Turn) -> tuple[str | None, list[int]]:
        """The text a client resends for this turn (prompt + plain-text reply) and the ids behind it.

        Only plain-text replies that ended at EOS or the length limit qualify: a stop string or a tool call
        is not resent as the model wrote it. A final EOS is left out of the ids: the next prompt's text
        renders it again as the template's end-of-turn token."""
        finish = turn.events[-1] if turn.events else None
        texts = [e.text for e in turn.events if isinstance(e, TextDelta)]
        if not isinstance(finish, Finish) or finish.reason not in ("stop", "length"):
            return None, []
        if len(texts) != len(turn.events) - 1:
            return None, []
        output = turn.output_ids
        if output and output[-1] == self.tokenizer.eos_token_id:
            output = output[:-1]
        return turn.meta["_prompt_text"] + "".join(texts), [*prompt, *output]

    ##### Health #####

    async def check_health(self) -> None:
        results = await asyncio.gather(*(client.health() for client in self.clients.values()))
        for url, ok in zip(self.clients, results, strict=True):
            (self.placement.mark_up if ok else self.placement.mark_down)(url)


def create_app(config: GatewayConfig, tokenizer: Tokenizer) -> FastAPI:
    """The gateway as an ASGI app; backend health is checked every `health_interval_s` while it runs."""
    from contextlib import asynccontextmanager

    state: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as http:
            gateway = Gateway(config, tokenizer, http)
            state["gateway"] = gateway
            task = asyncio.create_task(_health_loop(gateway, config.health_interval_s))
            try:
                yield
            finally:
                task.cancel()

    app = FastAPI(title="Loom gateway", lifespan=lifespan)
    anthropic, chat, responses = AnthropicMessages(), OpenAIChat(), OpenAIResponses()

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return JSONResponse({"status": "ok", "service": "loom"})

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await state["gateway"].handle(anthropic, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await _count_tokens(state["gateway"], anthropic, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await state["gateway"].handle(chat, request)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await state["gateway"].handle(responses, request)

    @app.get("/v1/models")
    async def models() -> Response:
        names = [config.served_model, *config.model_aliases]
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "loom"} for name in names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/loom/sessions")
    async def sessions() -> Response:
        return JSONResponse({"sessions": [s.as_json() for s in state["gateway"].sessions.recent()]})

    @app.get("/v1/loom/sessions/{session_id:path}")
    async def session(session_id: str) -> Response:
        stats = state["gateway"].sessions.get(session_id)
        if stats is None:
            return JSONResponse({"error": {"message": f"unknown session {session_id!r}"}}, status_code=404)
        return JSONResponse(stats.as_json())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["gateway"].metrics.render(), media_type="text/plain; version=0.0.4")

    return app


async def _health_loop(gateway: Gateway, interval_s: float) -> None:
    while True:
        await gateway.check_health()
        await asyncio.sleep(interval_s)


async def _count_tokens(gateway: Gateway, api: Api, request: Request) -> Response:
    try:
        body = await gateway._body(request)
        if isinstance(body, dict):
            body.setdefault("max_tokens", 1)
        conversation = gateway._parse(api, body, request.headers)
    except HTTPFailure as failure:
        return JSONResponse(api.error(failure.status, failure.message), status_code=failure.status)
    prompt = gateway.tokenizer.encode(
        render_prompt(conversation, gateway.tokenizer), add_special_tokens=False
    )
    return JSONResponse({"input_tokens": len(prompt)})
