"""The Anthropic Messages API adapter: request parsing, response rendering and SSE streaming, no HTTP.

Parsing (`parse_messages_request`) turns a `POST /v1/messages` body into a `Conversation`:

- `system` (a string or a list of text blocks) becomes one leading `system` message, blocks joined with
  `BLOCK_SEPARATOR`. Claude Code's first block, `x-anthropic-billing-header: cc_version=...;`
  (`BILLING_HEADER_PREFIX`), carries a per-conversation hash and is dropped so that conversations share a
  prefix (clients.md §3.3, §7).
- `messages` keep their order. `role: "system"` entries inside `messages` (Claude Code's
  `mid-conversation-system` beta) stay `system` messages in place. A string content and a list holding one
  text block give identical messages. Assistant `thinking` blocks become `reasoning`; `redacted_thinking` is
  dropped (its data is opaque). `tool_use` blocks become `ToolCall`s whose arguments are the `input` object
  as compact JSON in the client's key order. A user message's `tool_result` blocks become one `tool` message
  each, in order, followed by one `user` message for its text blocks, if any.
- `cache_control`, `signature`, `citations` and other unknown keys are ignored, as are the request fields
  the `Conversation` has no place for (`thinking`, `output_config`, `context_management`, `service_tier`).
- Images, documents and server tools are refused. Every refusal raises `InvalidRequest` (a 400) naming the
  field path, e.g. `messages[1].content[0].tool_use_id: expected a string, got int`.

Rendering (`render_message`) builds the non-streaming JSON answer from `OutputEvent`s; `MessageStream`
turns the same events into SSE frames. Claude Code needs an `event:` line on every frame and
`message_start`, `content_block_start` and `content_block_stop` around each block (clients.md §3.8);
`message_delta` and `message_stop` are sent too. Thinking blocks carry an empty `signature` (the gateway
has none to give; Claude Code echoes it back as `""`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal, TypeVar

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
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
    Usage,
)

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
BLOCK_SEPARATOR = "\n\n"
"""Joins the text blocks of one message (and the system blocks) into one string."""

STOP_REASONS: dict[FinishReason, str] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "stop_sequence": "stop_sequence",
}

T = TypeVar("T")

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
]


class InvalidRequest(ValueError):
    """The client's request is malformed or asks for something the gateway does not support (HTTP 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# ----------------------------------------------------------------------------------------------------------
# Request parsing


def parse_messages_request(body: object) -> Conversation:
    """Parse an Anthropic Messages request body (already JSON-decoded) into a `Conversation`."""
    request = _as_object(body, "body")
    model = _required(request, "model", str, "")
    max_tokens = _required(request, "max_tokens", int, "")
    if max_tokens < 1:
        raise InvalidRequest("max_tokens: must be at least 1")
    raw_messages = _required(request, "messages", list, "")
    if not raw_messages:
        raise InvalidRequest("messages: must not be empty")

    messages = _parse_system(request.get("system"))
    for i, raw in enumerate(raw_messages):
        messages.extend(_parse_message(raw, f"messages[{i}]"))

    hints: dict[str, str] = {}
    metadata = _optional(request, "metadata", dict, "")
    if metadata is not None:
        user_id = _optional(metadata, "user_id", str, "metadata")
        if user_id is not None:
            hints["metadata.user_id"] = user_id

    return Conversation(
        model=model,
        messages=tuple(messages),
        tools=_parse_tools(_optional(request, "tools", list, "")),
        max_output_tokens=max_tokens,
        temperature=_optional_number(request, "temperature"),
        top_p=_optional_number(request, "top_p"),
        top_k=_optional(request, "top_k", int, ""),
        stop=tuple(_string_list(_optional(request, "stop_sequences", list, ""), "stop_sequences")),
        stream=_optional(request, "stream", bool, "") or False,
        tool_choice=_parse_tool_choice(request.get("tool_choice")),
        session_hints=hints,
    )


def _parse_system(system: object) -> list[Message]:
    if system is None:
        return []
    if isinstance(system, str):
        return [Message(role="system", content=system)] if system else []
    blocks = _as_list(system, "system")
    texts = [_text_block(block, f"system[{i}]") for i, block in enumerate(blocks)]
    for i, text in enumerate(texts):
        if text.startswith(BILLING_HEADER_PREFIX):
            del texts[i]
            break
    return [Message(role="system", content=BLOCK_SEPARATOR.join(texts))] if texts else []


def _parse_message(raw: object, path: str) -> list[Message]:
    message = _as_object(raw, path)
    role = _required(message, "role", str, path)
    content = message.get("content")
    if role == "user":
        return _parse_user_content(content, f"{path}.content")
    if role == "assistant":
        return [_parse_assistant_content(content, f"{path}.content")]
    if role == "system":
        return [Message(role="system", content=_plain_text(content, f"{path}.content"))]
    raise InvalidRequest(f"{path}.role: unknown role {role!r} (expected 'user', 'assistant' or 'system')")


def _parse_user_content(content: object, path: str) -> list[Message]:
    if isinstance(content, str):
        return [Message(role="user", content=content)]
    blocks = _as_list(content, path)
    tool_results: list[Message] = []
    texts: list[str] = []
    for i, raw in enumerate(blocks):
        block_path = f"{path}[{i}]"
        block = _as_object(raw, block_path)
        kind = _required(block, "type", str, block_path)
        if kind == "text":
            texts.append(_required(block, "text", str, block_path))
        elif kind == "tool_result":
            tool_results.append(_parse_tool_result(block, block_path))
        else:
            raise _unsupported_block(kind, block_path, "user")
    if texts or not tool_results:
        return [*tool_results, Message(role="user", content=BLOCK_SEPARATOR.join(texts))]
    return tool_results


def _parse_tool_result(block: Mapping[str, object], path: str) -> Message:
    tool_use_id = _required(block, "tool_use_id", str, path)
    is_error = _optional(block, "is_error", bool, path) or False
    content = block.get("content")
    text = "" if content is None else _plain_text(content, f"{path}.content")
    return Message(role="tool", content=text, tool_call_id=tool_use_id, is_error=is_error)


def _parse_assistant_content(content: object, path: str) -> Message:
    if isinstance(content, str):
        return Message(role="assistant", content=content)
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for i, raw in enumerate(_as_list(content, path)):
        block_path = f"{path}[{i}]"
        block = _as_object(raw, block_path)
        kind = _required(block, "type", str, block_path)
        if kind == "text":
            texts.append(_required(block, "text", str, block_path))
        elif kind == "thinking":
            thoughts.append(_required(block, "thinking", str, block_path))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            tool_input = _required(block, "input", dict, block_path)
            calls.append(
                ToolCall(
                    id=_required(block, "id", str, block_path),
                    name=_required(block, "name", str, block_path),
                    arguments=json.dumps(tool_input, separators=(",", ":"), ensure_ascii=False),
                )
            )
        else:
            raise _unsupported_block(kind, block_path, "assistant")
    return Message(
        role="assistant",
        content=BLOCK_SEPARATOR.join(texts),
        tool_calls=tuple(calls),
        reasoning=BLOCK_SEPARATOR.join(thoughts),
    )


def _plain_text(content: object, path: str) -> str:
    """A string, or a list of text blocks joined (system messages, tool results)."""
    if isinstance(content, str):
        return content
    blocks = _as_list(content, path)
    return BLOCK_SEPARATOR.join(_text_block(block, f"{path}[{i}]") for i, block in enumerate(blocks))


def _text_block(raw: object, path: str) -> str:
    block = _as_object(raw, path)
    kind = _required(block, "type", str, path)
    if kind != "text":
        raise _unsupported_block(kind, path, "text-only")
    return _required(block, "text", str, path)


def _unsupported_block(kind: str, path: str, where: str) -> InvalidRequest:
    if kind in ("image", "document"):
        return InvalidRequest(f"{path}: {kind} content is not supported by this gateway (text only)")
    return InvalidRequest(f"{path}.type: unsupported content block type {kind!r} in {where} content")


def _parse_tools(raw_tools: list[object] | None) -> tuple[ToolSpec, ...]:
    if raw_tools is None:
        return ()
    tools: list[ToolSpec] = []
    for i, raw in enumerate(raw_tools):
        path = f"tools[{i}]"
        tool = _as_object(raw, path)
        kind = _optional(tool, "type", str, path)
        if kind not in (None, "custom"):
            raise InvalidRequest(f"{path}.type: server tool {kind!r} is not supported (only client tools)")
        tools.append(
            ToolSpec(
                name=_required(tool, "name", str, path),
                description=_optional(tool, "description", str, path) or "",
                parameters=_required(tool, "input_schema", dict, path),
            )
        )
    return tuple(tools)


def _parse_tool_choice(raw: object) -> str:
    if raw is None:
        return "auto"
    choice = _as_object(raw, "tool_choice")
    kind = _required(choice, "type", str, "tool_choice")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return _required(choice, "name", str, "tool_choice")
    raise InvalidRequest(
        f"tool_choice.type: unknown value {kind!r} (expected 'auto', 'any', 'tool' or 'none')"
    )


# Small typed accessors: each names the field path in its error.


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(expected: type) -> str:
    names = {str: "a string", int: "an integer", bool: "a boolean", list: "an array", dict: "an object"}
    return names.get(expected, expected.__name__)


def _check(value: object, expected: type[T], path: str) -> T:
    # bool is a subclass of int: `"max_tokens": true` must not pass as an integer.
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return value
    raise InvalidRequest(f"{path}: expected {_type_name(expected)}, got {type(value).__name__}")


def _required(obj: Mapping[str, object], key: str, expected: type[T], path: str) -> T:
    if key not in obj:
        raise InvalidRequest(f"{_join(path, key)}: field required")
    return _check(obj[key], expected, _join(path, key))


def _optional(obj: Mapping[str, object], key: str, expected: type[T], path: str) -> T | None:
    value = obj.get(key)
    return None if value is None else _check(value, expected, _join(path, key))


def _optional_number(obj: Mapping[str, object], key: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{key}: expected a number, got {type(value).__name__}")
    return float(value)


def _as_object(value: object, path: str) -> dict[str, object]:
    return _check(value, dict, path)


def _as_list(value: object, path: str) -> list[object]:
    return _check(value, list, path)


def _string_list(values: list[object] | None, path: str) -> list[str]:
    return [_check(v, str, f"{path}[{i}]") for i, v in enumerate(values or [])]


# ----------------------------------------------------------------------------------------------------------
# Responses


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def _tool_input(arguments: str) -> object:
    """The tool_use `input` object; arguments that are not a JSON object come back as `{"raw": text}`."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"raw": arguments}
    return parsed if isinstance(parsed, dict) else {"raw": arguments}


def render_message(events: list[OutputEvent], model: str, message_id: str) -> dict[str, object]:
    """The non-streaming Messages response for a complete event list (which must end with `Finish`)."""
    blocks: list[dict[str, object]] = []
    tool_arguments: dict[int, list[str]] = {}
    tool_blocks: dict[int, dict[str, object]] = {}
    finish: Finish | None = None
    for event in events:
        last = blocks[-1] if blocks else None
        if isinstance(event, TextDelta):
            if last is not None and last["type"] == "text":
                last["text"] = f"{last['text']}{event.text}"
            elif event.text:
                blocks.append({"type": "text", "text": event.text})
        elif isinstance(event, ReasoningDelta):
            if last is not None and last["type"] == "thinking":
                last["thinking"] = f"{last['thinking']}{event.text}"
            elif event.text:
                blocks.append({"type": "thinking", "thinking": event.text, "signature": ""})
        elif isinstance(event, ToolCallStart):
            block: dict[str, object] = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            blocks.append(block)
            tool_blocks[event.index] = block
            tool_arguments[event.index] = []
        elif isinstance(event, ToolCallArgumentsDelta):
            tool_arguments[event.index].append(event.text)
        elif isinstance(event, Finish):
            finish = event
    if finish is None:
        raise ValueError("render_message needs a complete event list ending with Finish")
    for index, block in tool_blocks.items():
        block["input"] = _tool_input("".join(tool_arguments[index]))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": STOP_REASONS[finish.reason],
        "stop_sequence": finish.stop_sequence if finish.reason == "stop_sequence" else None,
        "usage": _usage(finish.usage),
    }


def sse_frame(event_type: str, data: Mapping[str, object]) -> str:
    """One server-sent event; Claude Code requires the `event:` line (clients.md §3.8)."""
    return f"event: {event_type}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def error_frame(message: str, error_type: ErrorType = "api_error") -> str:
    """A mid-stream failure; Claude Code retries `overloaded_error` and `api_error` with the same body."""
    return sse_frame("error", {"type": "error", "error": {"type": error_type, "message": message}})


class MessageStream:
    """Turns `OutputEvent`s, fed one at a time, into Anthropic SSE frames.

    Frames: `message_start`, `ping`, then per content block `content_block_start`, its deltas and
    `content_block_stop`, then on `Finish` a `message_delta` (stop reason and full usage, input tokens
    included, so a `start()` without token counts is fine) and `message_stop`. Blocks are sequential: a new
    text, thinking or tool block closes the open one, so tool-call argument deltas must arrive while their
    block is open.
    """

    def __init__(self, model: str, message_id: str) -> None:
        self.model = model
        self.message_id = message_id
        self._started = False
        self._finished = False
        self._next_block = 0
        self._open: tuple[str, int] | None = None
        """The open block: its kind ("text", "thinking" or "tool_use") and its index."""
        self._open_tool: int | None = None
        """The `ToolCallStart.index` of the open tool_use block."""

    def start(self, prompt_tokens: int = 0, cached_tokens: int = 0) -> list[str]:
        """`message_start` and `ping`; `feed` calls it with zero counts if the caller did not."""
        if self._started:
            raise RuntimeError("MessageStream.start called twice")
        self._started = True
        usage = _usage(Usage(prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=cached_tokens))
        message: dict[str, object] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [sse_frame("message_start", {"type": "message_start", "message": message}), _PING]

    def feed(self, event: OutputEvent) -> list[str]:
        if self._finished:
            raise RuntimeError(f"MessageStream got {type(event).__name__} after Finish")
        frames = [] if self._started else self.start()
        if isinstance(event, TextDelta | ReasoningDelta):
            if event.text:
                kind = "text" if isinstance(event, TextDelta) else "thinking"
                frames += self._open_block(kind, _EMPTY_BLOCKS[kind])
                delta: dict[str, object] = (
                    {"type": "text_delta", "text": event.text}
                    if kind == "text"
                    else {"type": "thinking_delta", "thinking": event.text}
                )
                frames.append(self._delta(delta))
        elif isinstance(event, ToolCallStart):
            frames += self._close_block()
            frames += self._open_block(
                "tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            )
            self._open_tool = event.index
        elif isinstance(event, ToolCallArgumentsDelta):
            self._check_tool_open(event.index)
            if event.text:
                frames.append(self._delta({"type": "input_json_delta", "partial_json": event.text}))
        elif isinstance(event, ToolCallEnd):
            self._check_tool_open(event.index)
            frames += self._close_block()
        else:
            frames += self._finish(event)
        return frames

    def _finish(self, finish: Finish) -> list[str]:
        frames = self._close_block()
        self._finished = True
        delta = {
            "stop_reason": STOP_REASONS[finish.reason],
            "stop_sequence": finish.stop_sequence if finish.reason == "stop_sequence" else None,
        }
        message_delta = {"type": "message_delta", "delta": delta, "usage": _usage(finish.usage)}
        frames.append(sse_frame("message_delta", message_delta))
        frames.append(sse_frame("message_stop", {"type": "message_stop"}))
        return frames

    def _open_block(self, kind: str, content_block: dict[str, object]) -> list[str]:
        if self._open is not None and self._open[0] == kind and kind != "tool_use":
            return []
        frames = self._close_block()
        self._open = (kind, self._next_block)
        self._next_block += 1
        start = {"type": "content_block_start", "index": self._open[1], "content_block": content_block}
        return [*frames, sse_frame("content_block_start", start)]

    def _close_block(self) -> list[str]:
        if self._open is None:
            return []
        index = self._open[1]
        self._open = None
        self._open_tool = None
        return [sse_frame("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _delta(self, delta: dict[str, object]) -> str:
        if self._open is None:
            raise RuntimeError("MessageStream: a delta with no open content block")
        event = {"type": "content_block_delta", "index": self._open[1], "delta": delta}
        return sse_frame("content_block_delta", event)

    def _check_tool_open(self, index: int) -> None:
        if self._open_tool != index:
            raise RuntimeError(
                f"tool call {index} is not the open content block (open: {self._open_tool}); "
                "the output parser must emit each tool call's events contiguously"
            )


_PING = sse_frame("ping", {"type": "ping"})
_EMPTY_BLOCKS: dict[str, dict[str, object]] = {
    "text": {"type": "text", "text": ""},
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
}


# ----------------------------------------------------------------------------------------------------------
# Errors


def error_type_for(status: int) -> ErrorType:
    """Anthropic's error type for an HTTP status."""
    if status in (529, 503):
        return "overloaded_error"
    specific: dict[int, ErrorType] = {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
    }
    if status in specific:
        return specific[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(status: int, message: str) -> dict[str, object]:
    """The JSON body of an error response: `{"type": "error", "error": {"type": ..., "message": ...}}`."""
    return {"type": "error", "error": {"type": error_type_for(status), "message": message}}
