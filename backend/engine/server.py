"""SGLang-compatible native HTTP API over the embedded engine: ``python -m backend.engine.server``.

`create_app(runner)` builds the FastAPI app around an `EngineRunner` (`backend.engine.launch`, with
the command line), which owns the `Engine`.

Threading (details in `backend.engine.launch`): one thread owns the engine and steps it; handlers
send it commands (add, abort, flush) through a queue and await `concurrent.futures.Future`s; after
each step the loop posts each changed request's `Delta` into that request's `asyncio.Queue` with
`loop.call_soon_threadsafe`. /metrics and /get_server_info read an immutable `Snapshot`.

API: SGLang 0.5.23's native endpoints and shapes
------------------------------------------------
``POST /generate`` {text | input_ids, sampling_params {max_new_tokens, temperature, top_p, top_k,
stop, stop_token_ids, ignore_eos, seed, no_stop_trim}, stream, rid, return_logprob,
logprob_start_len, return_text_in_logprobs} answers {"text", "output_ids", "meta_info"}. Text is
tokenized as SGLang does (``tokenizer(text)``: the tokenizer's own special tokens, none for
SmolLM2) and output decoded with special tokens skipped; a matched stop string (or a matched stop
token's text) is cut from the text unless ``no_stop_trim``. A batch (list of prompts) is refused.
meta_info: id, finish_reason ({"type": "length", "length"} | {"type": "stop", "matched"} |
{"type": "abort", "message", ...}), prompt_tokens, completion_tokens, cached_tokens (device hits +
host loads), cached_tokens_details {device, host}, reasoning_tokens, weight_version,
num_retractions, first_token_latency and (when finished) e2e_latency in seconds, and Loom's
recomputed_hole_tokens and host_loaded_tokens. With return_logprob: input_token_logprobs (from
logprob_start_len; -1 gives none) and output_token_logprobs as SGLang's [logprob, token_id,
text-or-None] triples (the first prompt token's logprob is None), output_token_logprobs_length.

Streaming sends ``data: {same shape}\\n\\n`` after every step that produced tokens, with the
cumulative text and output_ids (SGLang's default, non-incremental mode), then ``data: [DONE]\\n\\n``.
Unlike SGLang, a chunk holds back a tail that could begin a stop string (and an incomplete UTF-8
character), so each chunk's text is a prefix of the next. A client disconnect aborts the request.

``GET /health`` (200 while the loop runs, else 503), ``GET /get_model_info`` and
``GET /get_server_info`` (also as /model_info, /server_info), ``GET|POST /flush_cache`` (200, or 400
while requests run; plain text as SGLang), ``POST /abort_request`` {"rid", "abort_all"} (200 always,
as SGLang; body {"aborted": n}), ``GET /metrics`` (Prometheus text, below).

Metrics: SGLang's names where Loom counts the same thing (no labels but cache_source):
sglang:prompt_tokens_total, sglang:generation_tokens_total, sglang:cached_tokens_total{cache_source=
device|host}, sglang:load_back_tokens_total (host loads), sglang:num_running_reqs,
sglang:num_queue_reqs, sglang:token_usage (pages held by requests, own or locked, over capacity),
sglang:time_to_first_token_seconds and sglang:e2e_request_latency_seconds (histograms),
sglang:num_requests_total, sglang:num_aborted_requests_total. Loom's own: loom_recomputed_hole_tokens_total,
loom_evicted_tokens_total (deleted from either tier; SGLang's evicted_tokens_total counts device
slots freed, offloads included), loom_offloaded_tokens_total, loom_kv_usage (pages in use plus
cached over capacity), loom_kv_cached_tokens, loom_host_kv_cached_tokens.

Errors: every client error is HTTP 400 ``{"error": {"message", "type": "invalid_request_error",
"code": 400}}`` (SGLang's 400 envelope plus type and code): malformed JSON, unknown or mistyped
fields (strict: no string-to-number coercion), both or neither of text and input_ids, bad sampling
values, and whatever the engine refuses (empty prompt, token ids outside the vocabulary, a prompt
plus max_new_tokens the KV cache or the model's positions cannot hold, a rid in use). A dead
engine loop is 503 (``service_unavailable``); an engine failure during a request is 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from importlib import metadata
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.engine.engine import Request
from backend.engine.runner import Delta, EngineRunner, EngineUnavailable, Failure, TextCodec
from backend.engine.sampling import SamplingParams

__all__ = ["AbortBody", "GenerateBody", "SamplingParamsBody", "create_app"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DISCONNECT_POLL_S = 1.0
"""How often a non-streaming handler checks whether its client left (then it aborts the request)."""


##### Request bodies #####


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingParamsBody(_Body):
    """SGLang's sampling_params subset the engine implements; null means the engine's default."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    no_stop_trim: bool = False


class GenerateBody(_Body):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParamsBody | None = None
    stream: bool = False
    rid: Annotated[str, Field(min_length=1)] | None = None
    return_logprob: bool = False
    logprob_start_len: Annotated[int, Field(ge=-1)] = -1
    return_text_in_logprobs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_batches(cls, data: Any) -> Any:
        if isinstance(data, dict):
            text, ids = data.get("text"), data.get("input_ids")
            if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
                raise ValueError("batch requests (a list of prompts) are not supported: send one per prompt")
        return data

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of 'text' and 'input_ids' is required")
        return self


class AbortBody(_Body):
    rid: str = ""
    abort_all: bool = False


class APIError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "invalid_request_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


_B = TypeVar("_B", bound=_Body)


async def _parse(http: HTTPRequest, model: type[_B]) -> _B:
    """The body as `model`, whatever its content type (``curl -d`` sends form-encoded); APIError 400."""
    raw = await http.body()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise APIError(400, _validation_message(exc.errors())) from exc


def _validation_message(errors: Sequence[Any]) -> str:
    parts = []
    for error in errors:
        where = ".".join(str(p) for p in error["loc"] if p != "body")
        kind, message = error["type"], str(error["msg"]).removeprefix("Value error, ")
        if kind == "extra_forbidden":
            parts.append(f"unknown field {where!r}")
        else:
            parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


##### Responses #####


class _Output:
    """A request's deltas gathered into SGLang's response (cumulative text and ids). Of the engine's
    `Request` it reads only what was fixed before submission: rid, prompt, params, logprob start."""

    def __init__(self, request: Request, body: GenerateBody, codec: TextCodec, no_stop_trim: bool) -> None:
        self.request, self.body, self.codec, self.no_stop_trim = request, body, codec, no_stop_trim
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.prompt_logprobs: list[float | None] = []
        self.last: Delta | None = None
        self._text_ids: list[int] = []
        self._text, self._surr, self._read, self._shown = "", 0, 0, 0

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    def apply(self, delta: Delta) -> None:
        self.output_ids += delta.output_ids
        self.output_logprobs += delta.output_logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.last = delta
        text_ids = delta.output_ids
        matched = (delta.finish_reason or {}).get("matched")
        if isinstance(matched, int) and text_ids and not self.no_stop_trim:
            text_ids = text_ids[:-1]  # as SGLang: a matched stop token adds no text
        self._text_ids += text_ids
        # Incremental decode as SGLang's detokenizer: re-decode from a surrogate offset so that byte
        # pieces of one character come out whole; commit only text not ending in U+FFFD.
        decode = self.codec.decode
        new = decode(self._text_ids[self._surr :])[len(decode(self._text_ids[self._surr : self._read])) :]
        if new and not new.endswith("\ufffd"):
            self._text += new
            self._surr, self._read = self._read, len(self._text_ids)

    def text(self) -> str:
        if not self.finished:
            self._shown = _streamable(self._text, self.request.params.stop, self._shown)
            return self._text[: self._shown]
        text = self.codec.decode(self._text_ids)
        assert self.last is not None and self.last.finish_reason is not None
        matched = self.last.finish_reason.get("matched")
        if isinstance(matched, str) and (pos := text.find(matched)) >= 0:
            # As SGLang: cut the stop string, or with no_stop_trim keep it; never keep text after it.
            text = text[: pos + len(matched)] if self.no_stop_trim else text[:pos]
        return text

    def json(self) -> dict[str, Any]:
        assert self.last is not None
        d = self.last
        reason = d.finish_reason
        if reason is not None and reason.get("type") == "abort":
            reason = {"message": "Aborted", "status_code": None, "err_type": None} | reason
        meta: dict[str, Any] = {
            "id": self.request.rid,
            "finish_reason": reason,
            "prompt_tokens": len(self.request.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": d.cached_tokens,
            "cached_tokens_details": {
                "device": d.cached_tokens - d.host_loaded_tokens,
                "host": d.host_loaded_tokens,
            },
            "reasoning_tokens": 0,
            "weight_version": "default",
            "num_retractions": 0,
            "recomputed_hole_tokens": d.recomputed_hole_tokens,
            "host_loaded_tokens": d.host_loaded_tokens,
        }
        if d.first_token_latency is not None:
            meta["first_token_latency"] = d.first_token_latency
        if d.e2e_latency is not None:
            meta["e2e_latency"] = d.e2e_latency
        if self.body.return_logprob:
            start = max(self.request.logprob_start_len, 0)
            prompt_ids = self.request.prompt_ids[start : start + len(self.prompt_logprobs)]
            meta["input_token_logprobs"] = self._triples(self.prompt_logprobs, prompt_ids)
            meta["output_token_logprobs"] = self._triples(self.output_logprobs, self.output_ids)
            meta["output_token_logprobs_length"] = len(self.output_logprobs)
        return {"text": self.text(), "output_ids": list(self.output_ids), "meta_info": meta}

    def _triples(self, logprobs: Sequence[float | None], ids: Sequence[int]) -> list[list[Any]]:
        with_text = self.body.return_text_in_logprobs
        return [
            [lp, t, self.codec.decode([t]) if with_text else None]
            for lp, t in zip(logprobs, ids, strict=True)
        ]


def _streamable(text: str, stops: Sequence[str], shown: int) -> int:
    """How much of `text` a stream chunk shows: all but a tail that could begin a stop string, and
    never less than was shown before (so every chunk's text is a prefix of the next)."""
    keep = len(text)
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                keep = min(keep, len(text) - k)
                break
    return max(keep, shown)


def _sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _sampling(given: SamplingParamsBody | None) -> SamplingParams:
    values = given.model_dump(exclude_none=True, exclude={"no_stop_trim"}) if given else {}
    if isinstance(stop := values.get("stop"), str | list):
        values["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(values["stop"]):
            raise APIError(400, "sampling_params.stop: stop strings must not be empty")
    if "stop_token_ids" in values:
        values["stop_token_ids"] = tuple(values["stop_token_ids"])
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise APIError(400, f"sampling_params: {exc}") from exc


async def _engine_result(future: concurrent.futures.Future[T]) -> T:
    try:
        return await asyncio.wrap_future(future)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc)) from exc


##### The app #####


def create_app(runner: EngineRunner) -> FastAPI:
    """The SGLang-native API over `runner`; its lifespan starts and stops the engine loop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            await asyncio.to_thread(runner.stop)

    app = FastAPI(title="Loom engine (SGLang native API)", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc.errors()))

    @app.exception_handler(APIError)
    async def on_api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.api_route("/generate", methods=["POST", "PUT"], response_model=None)
    async def generate(http: HTTPRequest) -> Response:
        received = time.perf_counter()
        body = await _parse(http, GenerateBody)
        prompt = body.input_ids
        if prompt is None:
            assert body.text is not None
            prompt = await asyncio.to_thread(runner.codec.encode, body.text)
        if body.return_logprob and body.logprob_start_len > len(prompt):
            raise APIError(400, f"logprob_start_len {body.logprob_start_len} is beyond the prompt's "
                                f"{len(prompt)} tokens")  # fmt: skip
        request = Request(
            rid=body.rid or uuid.uuid4().hex,
            prompt_ids=list(prompt),
            params=_sampling(body.sampling_params),
            return_logprob=body.return_logprob,
            logprob_start_len=body.logprob_start_len if body.return_logprob else -1,
            arrival_s=received,
        )
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue[Delta | Failure]()

        def post(item: Delta | Failure) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
                logger.debug("dropped an update for %s after the event loop closed", request.rid)

        try:
            await _engine_result(runner.submit(request, post))
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        output = _Output(request, body, runner.codec, body.sampling_params is not None
                         and body.sampling_params.no_stop_trim)  # fmt: skip

        def abort_unfinished() -> None:
            if not output.finished:
                runner.abort(request.rid, only=request)

        if body.stream:
            return StreamingResponse(_stream(inbox, output, abort_unfinished), media_type="text/event-stream",
                                     background=BackgroundTask(abort_unfinished))  # fmt: skip
        next_check = time.monotonic() + _DISCONNECT_POLL_S
        while not output.finished:
            try:
                item = await asyncio.wait_for(inbox.get(), _DISCONNECT_POLL_S)
            except TimeoutError:
                item = None
            if isinstance(item, Failure):
                raise APIError(item.status, item.message)
            if item is not None:
                output.apply(item)
            if time.monotonic() >= next_check:  # the client may have left: stop computing for nobody
                next_check = time.monotonic() + _DISCONNECT_POLL_S
                if await http.is_disconnected():
                    abort_unfinished()
        return JSONResponse(output.json())

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if runner.alive else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": runner.args.model_path,
            "served_model_name": runner.args.model_path,
            "tokenizer_path": runner.args.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "model_config": asdict(runner.engine.model.config),
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        config, snapshot = runner.engine.config, runner.snapshot
        return {
            **asdict(runner.args),
            **asdict(config),
            # SGLang's names for the same settings
            "max_total_num_tokens": config.kv_cache_tokens,
            "radix_eviction_policy": config.eviction_policy,
            "chunked_prefill_size": config.max_batch_tokens,
            "enable_hierarchical_cache": config.host_kv_tokens > 0,
            "enable_deterministic_inference": config.deterministic,
            "random_seed": config.seed,
            "device": str(runner.engine.device),
            "dtype": str(next(runner.engine.model.parameters()).dtype).removeprefix("torch."),
            "internal_states": [
                asdict(snapshot) | {"token_usage": snapshot.token_usage, "kv_usage": snapshot.kv_usage}
            ],
            "version": _version(),
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if await _engine_result(runner.call(lambda engine: engine.flush_cache())):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(http: HTTPRequest) -> dict[str, int]:
        body = await _parse(http, AbortBody)
        if not body.abort_all and not body.rid:
            raise APIError(400, "give a 'rid' or 'abort_all': true")
        return {"aborted": await _engine_result(runner.abort(None if body.abort_all else body.rid))}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(runner.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _stream(
    inbox: asyncio.Queue[Delta | Failure], output: _Output, abort_unfinished: Callable[[], None]
) -> AsyncIterator[bytes]:
    """SSE chunks, one per batch of deltas; a cancelled stream (client gone) aborts the request."""
    try:
        while not output.finished:
            items = [await inbox.get()]
            while not inbox.empty():
                items.append(inbox.get_nowait())
            for item in items:
                if isinstance(item, Failure):
                    kind = "server_error" if item.status == 500 else "service_unavailable"
                    yield _sse({"error": {"message": item.message, "type": kind, "code": item.status}})
                    yield b"data: [DONE]\n\n"
                    return
                output.apply(item)
            yield _sse(output.json())
        yield b"data: [DONE]\n\n"
    finally:
        abort_unfinished()


def _version() -> str:
    try:
        return metadata.version("loom-gateway")
    except metadata.PackageNotFoundError:
        return "0+unknown"


if __name__ == "__main__":
    from backend.engine.launch import main

    main()
