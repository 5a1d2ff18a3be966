"""OpenAI Chat Completions adapter: request body → `Conversation`, `OutputEvent`s → response body or SSE.

Pure functions, no I/O. The server parses with `parse_chat_request`, reads `stream_include_usage` (the
`Conversation` has no place for it), and renders either the whole answer with `render_chat_completion` or
a stream with one `ChatStream` per request.

Request mapping:
- `messages`: `system` and `developer` become system messages; `user`, `assistant` and `tool` keep their
  role. Content is a string or a list of `text` parts (joined in order, so both forms give the same
  `Conversation`); image, audio and file parts are refused.
- Assistant `tool_calls` keep their `arguments` text byte for byte; tool messages carry `tool_call_id`.
- `tools` of type `function`; `tool_choice` "auto" | "none" | "required" | {"type":"function",...}.
- `max_completion_tokens` (or the older `max_tokens`), `temperature`, `top_p`, `stop` (string or list),
  `stream`. `user` and `prompt_cache_key` go into `session_hints`. `n` other than 1 is refused; other
  fields (`metadata`, `seed`, `parallel_tool_calls`, ...) are ignored.

Errors: a malformed request raises `InvalidRequest` with the field path (e.g. `messages[2].content[0].type`);
`error_body` gives OpenAI's error envelope for any status. A missing `Finish` event, or events after it, is
a bug in the caller and raises `RuntimeError`.

Streaming chunks: the first carries `{"role": "assistant", "content": ""}`; then content deltas, tool-call
deltas (`index`, `id`, `type`, `function.name` with empty arguments first, then `function.arguments`
fragments), a chunk with an empty delta and the `finish_reason`, a usage chunk with `choices: []` when
`stream_options.include_usage` is set, and `data: [DONE]`. Reasoning text is sent as the non-standard
`reasoning_content` field (vLLM, DeepSeek), which the OpenAI SDK keeps as an extra attribute.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.conversation import (
    Conversation,
    Finish,
    FinishReason,
    Message,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolSpec,
    Usage,
)


class InvalidRequest(ValueError):
    """The client's request is malformed: a 400 with OpenAI's `invalid_request_error`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    """OpenAI's error envelope, shared by Chat Completions and Responses."""
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": None}}


# --- Field readers shared with the Responses adapter.


def require(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str) -> Any:
    if key not in body or body[key] is None:
        raise InvalidRequest(f"missing required field '{path}'", path)
    return expect(body[key], kind, path)


def optional(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str) -> Any:
    value = body.get(key)
    return None if value is None else expect(value, kind, path)


def expect(value: Any, kind: type | tuple[type, ...], path: str) -> Any:
    # bool is an int in Python; a number field must not accept true/false.
    numeric = kind in (int, float, (int, float))
    if not isinstance(value, kind) or (numeric and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise InvalidRequest(f"'{path}' must be {_JSON_NAMES.get(names, names)}", path)
    return value


_JSON_NAMES = {
    "str": "a string",
    "int": "an integer",
    "int or float": "a number",
    "dict": "an object",
    "list": "an array",
    "bool": "a boolean",
    "str or list": "a string or an array",
}


def optional_number(body: Mapping[str, Any], key: str, path: str) -> float | None:
    value = optional(body, key, (int, float), path)
    return None if value is None else float(value)


def parse_stop(body: Mapping[str, Any], path: str) -> tuple[str, ...]:
    stop = optional(body, "stop", (str, list), path)
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(expect(item, str, f"{path}[{i}]") for i, item in enumerate(stop))


# --- Request.


def parse_chat_request(body: Mapping[str, Any]) -> Conversation:
    """Parse a Chat Completions request body; raises `InvalidRequest` naming the offending field."""
    expect(body, dict, "body")
    model = require(body, "model", str, "model")
    raw_messages = require(body, "messages", list, "messages")
    if not raw_messages:
        raise InvalidRequest("'messages' must not be empty", "messages")
    n = optional(body, "n", int, "n")
    if n is not None and n != 1:
        raise InvalidRequest("only n=1 is supported", "n")
    max_tokens = optional(body, "max_completion_tokens", int, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = optional(body, "max_tokens", int, "max_tokens")
    return Conversation(
        model=model,
        messages=tuple(_message(m, f"messages[{i}]") for i, m in enumerate(raw_messages)),
        tools=_tools(optional(body, "tools", list, "tools") or []),
        max_output_tokens=max_tokens,
        temperature=optional_number(body, "temperature", "temperature"),
        top_p=optional_number(body, "top_p", "top_p"),
        stop=parse_stop(body, "stop"),
        stream=bool(optional(body, "stream", bool, "stream")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        session_hints=_session_hints(body),
    )


def stream_include_usage(body: Mapping[str, Any]) -> bool:
    """`stream_options.include_usage`: whether the stream ends with a usage chunk."""
    options = optional(body, "stream_options", dict, "stream_options") or {}
    return bool(optional(options, "include_usage", bool, "stream_options.include_usage"))


def _message(raw: Any, path: str) -> Message:
    expect(raw, dict, path)
    role = require(raw, "role", str, f"{path}.role")
    if role in ("system", "developer", "user"):
        content = _content(require(raw, "content", (str, list), f"{path}.content"), f"{path}.content")
        return Message("user" if role == "user" else "system", content)
    if role == "assistant":
        content = _content(optional(raw, "content", (str, list), f"{path}.content") or "", f"{path}.content")
        calls = optional(raw, "tool_calls", list, f"{path}.tool_calls") or []
        reasoning = optional(raw, "reasoning_content", str, f"{path}.reasoning_content") or ""
        return Message(
            "assistant",
            content,
            tool_calls=tuple(_tool_call(c, f"{path}.tool_calls[{i}]") for i, c in enumerate(calls)),
            reasoning=reasoning,
        )
    if role == "tool":
        return Message(
            "tool",
            _content(require(raw, "content", (str, list), f"{path}.content"), f"{path}.content"),
            tool_call_id=require(raw, "tool_call_id", str, f"{path}.tool_call_id"),
        )
    raise InvalidRequest(
        f"'{path}.role' must be system, developer, user, assistant or tool, not {role!r}", f"{path}.role"
    )


def _content(content: str | list[Any], path: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        expect(part, dict, f"{path}[{i}]")
        kind = require(part, "type", str, f"{path}[{i}].type")
        if kind != "text":
            raise InvalidRequest(
                f"content part type {kind!r} is not supported ('{path}[{i}].type'); only text parts are",
                f"{path}[{i}].type",
            )
        texts.append(require(part, "text", str, f"{path}[{i}].text"))
    return "".join(texts)


def _tool_call(raw: Any, path: str) -> ToolCall:
    expect(raw, dict, path)
    kind = optional(raw, "type", str, f"{path}.type") or "function"
    if kind != "function":
        raise InvalidRequest(f"'{path}.type': tool call type {kind!r} is not supported", f"{path}.type")
    function = require(raw, "function", dict, f"{path}.function")
    return ToolCall(
        id=require(raw, "id", str, f"{path}.id"),
        name=require(function, "name", str, f"{path}.function.name"),
        arguments=require(function, "arguments", str, f"{path}.function.arguments"),
    )


def _tools(raw: list[Any]) -> tuple[ToolSpec, ...]:
    tools = []
    for i, tool in enumerate(raw):
        path = f"tools[{i}]"
        expect(tool, dict, path)
        kind = require(tool, "type", str, f"{path}.type")
        if kind != "function":
            raise InvalidRequest(
                f"'{path}.type': tool type {kind!r} is not supported; only function tools are", f"{path}.type"
            )
        tools.append(function_spec(require(tool, "function", dict, f"{path}.function"), f"{path}.function"))
    return tuple(tools)


def function_spec(function: Mapping[str, Any], path: str) -> ToolSpec:
    """A function tool's name, description and JSON-schema parameters (OpenAI's field names)."""
    return ToolSpec(
        name=require(function, "name", str, f"{path}.name"),
        description=optional(function, "description", str, f"{path}.description") or "",
        parameters=optional(function, "parameters", dict, f"{path}.parameters") or {},
    )


def _tool_choice(raw: Any) -> str:
    return parse_tool_choice(raw, nested=True)


def parse_tool_choice(raw: Any, nested: bool) -> str:
    """ "auto", "none", "required" or a function name; Chat nests the name under "function"
    (`nested`), Responses does not."""
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise InvalidRequest("'tool_choice' must be auto, none, required or a function", "tool_choice")
        return raw
    expect(raw, dict, "tool_choice")
    if raw.get("type") != "function":
        raise InvalidRequest("'tool_choice.type' must be function", "tool_choice.type")
    holder, path = (
        (require(raw, "function", dict, "tool_choice.function"), "tool_choice.function")
        if nested
        else (raw, "tool_choice")
    )
    name: str = require(holder, "name", str, f"{path}.name")
    return name


def _session_hints(body: Mapping[str, Any]) -> dict[str, str]:
    hints = {}
    for key in ("user", "prompt_cache_key"):
        value = optional(body, key, str, key)
        if value:
            hints[key] = value
    return hints


# --- Response.

_FINISH_REASONS: dict[FinishReason, str] = {
    "stop": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
}


def _usage(usage: Usage) -> dict[str, object]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def render_chat_completion(
    events: Iterable[OutputEvent], model: str, completion_id: str, created: int
) -> dict[str, object]:
    """The non-streaming `chat.completion` body for a finished output."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish: Finish | None = None
    for event in events:
        if finish is not None:
            raise RuntimeError(f"output event {event!r} after Finish; the event source is broken")
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            function = {"name": event.name, "arguments": ""}
            calls[event.index] = {"id": event.id, "type": "function", "function": function}
        elif isinstance(event, ToolCallArgumentsDelta):
            if event.index not in calls:
                raise RuntimeError(f"arguments for tool call {event.index} before its ToolCallStart")
            calls[event.index]["function"]["arguments"] += event.text
        elif isinstance(event, Finish):
            finish = event
    if finish is None:
        raise RuntimeError("output ended without a Finish event; the event source is broken")
    message: dict[str, object] = {
        "role": "assistant",
        "content": "".join(text) if text or not calls else None,
    }
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _FINISH_REASONS[finish.reason],
                "logprobs": None,
            }
        ],
        "usage": _usage(finish.usage),
    }


def sse_data(payload: object) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ChatStream:
    """Turns `OutputEvent`s into `chat.completion.chunk` SSE frames, one instance per response."""

    def __init__(self, model: str, completion_id: str, created: int, include_usage: bool = False) -> None:
        self._model = model
        self._id = completion_id
        self._created = created
        self._include_usage = include_usage
        self._started = False
        self._finished = False

    def feed(self, event: OutputEvent) -> list[str]:
        if self._finished:
            raise RuntimeError(f"output event {event!r} after Finish; the event source is broken")
        frames = []
        if not self._started:
            self._started = True
            frames.append(self._chunk({"role": "assistant", "content": ""}))
        if isinstance(event, TextDelta):
            frames.append(self._chunk({"content": event.text}))
        elif isinstance(event, ReasoningDelta):
            frames.append(self._chunk({"reasoning_content": event.text}))
        elif isinstance(event, ToolCallStart):
            function = {"name": event.name, "arguments": ""}
            call = {"index": event.index, "id": event.id, "type": "function", "function": function}
            frames.append(self._chunk({"tool_calls": [call]}))
        elif isinstance(event, ToolCallArgumentsDelta):
            call = {"index": event.index, "function": {"arguments": event.text}}
            frames.append(self._chunk({"tool_calls": [call]}))
        elif isinstance(event, Finish):
            frames.extend(self._finish(event))
        return frames

    def _finish(self, finish: Finish) -> list[str]:
        self._finished = True
        frames = [self._chunk({}, _FINISH_REASONS[finish.reason])]
        if self._include_usage:
            frames.append(sse_data(self._envelope([], _usage(finish.usage))))
        frames.append("data: [DONE]\n\n")
        return frames

    def _chunk(self, delta: dict[str, object], finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return sse_data(self._envelope([choice], None))

    def _envelope(self, choices: list[object], usage: dict[str, object] | None) -> dict[str, object]:
        envelope: dict[str, object] = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }
        if self._include_usage:
            envelope["usage"] = usage
        return envelope
