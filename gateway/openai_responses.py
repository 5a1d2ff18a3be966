"""OpenAI Responses adapter, as Codex speaks it: request body → `Conversation`, `OutputEvent`s → SSE.

Pure functions, no I/O. The server parses with `parse_responses_request(body, headers)` and renders with one
`ResponseStream` per request (or `render_response` for `stream: false`).

Request mapping (clients.md §4.3-4.5):
- `instructions` becomes the first system message. Codex leaves it out and sends its base prompt as
  `developer` messages in `input`; `developer` and `system` messages become system messages.
- `input` is a string (one user message) or a list of items, each with an `id` that is ignored:
  - `message`: content is a string or `input_text` / `output_text` parts, joined in order (both forms give
    the same `Conversation`); image and file parts are refused.
  - `function_call` (`call_id`, `name`, `arguments` kept byte for byte) and `reasoning` join the assistant
    message around them: Codex sends reasoning, text and calls of one model turn as separate items.
    Reasoning text comes from `content` (`reasoning_text`) or else `summary` (`summary_text`); a reasoning
    item with only `encrypted_content` is skipped.
  - `function_call_output` (`call_id`, `output` as a string or text parts) becomes a tool message.
  - Anything else is refused, notably the gpt-6.x "responses-lite" `additional_tools` item (§4.6): configure
    Codex with a catalog model such as gpt-5.5, whose tools travel in `tools`.
- `tools`: `function` tools are kept. Every other type is dropped, not refused: Codex sends `custom`
  (apply_patch), `tool_search`, `web_search` and `namespace` tools with every request, so refusing them
  would refuse Codex. The model then does its work through the function tools (`exec_command`).
- `tool_choice` "auto" | "none" | "required" | {"type":"function","name":...}; `max_output_tokens`,
  `temperature`, `top_p`, `stream`. `previous_response_id` is refused: nothing is stored, so the client must
  send the whole input (Codex does, with `store: false`).
- Session hints: `prompt_cache_key` and `user` from the body; `session-id` and `thread-id` from the headers.
- Accepted and ignored: `store`, `include`, `parallel_tool_calls`, `reasoning`, `text` (so a title request's
  `text.format` JSON schema is not enforced), `client_metadata`, `metadata`, `truncation`, `service_tier`.

Output (§4.8): each item gets `response.output_item.added`, its deltas and a mandatory
`response.output_item.done`; the stream ends with a mandatory `response.completed` carrying usage. Output
items are a reasoning item (its text as a `summary_text` part, which Codex displays and sends back), a
`message` with one `output_text` part, and `function_call` items. A response cut at `max_output_tokens` also
ends with `response.completed`, with `status: "incomplete"`: Codex turns `response.incomplete` into an error
and retries the whole request. `ResponseStream.fail` ends a stream with `response.failed` (code
`server_error`), which Codex retries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.conversation import (
    Conversation,
    Finish,
    Message,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from gateway.openai_chat import InvalidRequest as InvalidRequest
from gateway.openai_chat import error_body as error_body
from gateway.openai_chat import expect, function_spec, optional, optional_number, parse_tool_choice, require

# --- Request.


def parse_responses_request(
    body: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> Conversation:
    """Parse a Responses request body; raises `InvalidRequest` naming the offending field."""
    expect(body, dict, "body")
    model = require(body, "model", str, "model")
    if body.get("previous_response_id") is not None:
        raise InvalidRequest(
            "previous_response_id is not supported: responses are not stored, send the whole input",
            "previous_response_id",
        )
    messages = []
    instructions = optional(body, "instructions", str, "instructions")
    if instructions:
        messages.append(Message("system", instructions))
    raw_input = require(body, "input", (str, list), "input")
    if isinstance(raw_input, str):
        messages.append(Message("user", raw_input))
    else:
        messages.extend(_Items().parse(raw_input))
    return Conversation(
        model=model,
        messages=tuple(messages),
        tools=_tools(optional(body, "tools", list, "tools") or []),
        max_output_tokens=optional(body, "max_output_tokens", int, "max_output_tokens"),
        temperature=optional_number(body, "temperature", "temperature"),
        top_p=optional_number(body, "top_p", "top_p"),
        stream=bool(optional(body, "stream", bool, "stream")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        session_hints=_session_hints(body, headers or {}),
    )


class _Items:
    """Input items → messages, merging the reasoning, text and calls of one assistant turn."""

    def __init__(self) -> None:
        self._messages: list[Message] = []
        self._reasoning: list[str] = []
        self._text: list[str] = []
        self._calls: list[ToolCall] = []

    def parse(self, items: list[Any]) -> list[Message]:
        for i, item in enumerate(items):
            self._item(item, f"input[{i}]")
        self._flush()
        return self._messages

    def _item(self, item: Any, path: str) -> None:
        expect(item, dict, path)
        kind = optional(item, "type", str, f"{path}.type") or "message"
        if kind == "message":
            self._message(item, path)
        elif kind == "function_call":
            self._calls.append(
                ToolCall(
                    id=require(item, "call_id", str, f"{path}.call_id"),
                    name=require(item, "name", str, f"{path}.name"),
                    arguments=require(item, "arguments", str, f"{path}.arguments"),
                )
            )
        elif kind == "function_call_output":
            self._flush()
            output = _text(require(item, "output", (str, list), f"{path}.output"), f"{path}.output")
            call_id = require(item, "call_id", str, f"{path}.call_id")
            self._messages.append(Message("tool", output, tool_call_id=call_id))
        elif kind == "reasoning":
            self._reasoning_item(item, path)
        elif kind == "additional_tools":
            raise InvalidRequest(
                f"'{path}.type': input item type 'additional_tools' (Codex's responses-lite shape for "
                "gpt-6.x models) is not supported; configure a catalog model such as gpt-5.5",
                f"{path}.type",
            )
        else:
            raise InvalidRequest(f"'{path}.type': input item type {kind!r} is not supported", f"{path}.type")

    def _message(self, item: Mapping[str, Any], path: str) -> None:
        role = require(item, "role", str, f"{path}.role")
        content = _text(require(item, "content", (str, list), f"{path}.content"), f"{path}.content")
        if role == "assistant":
            if self._calls:
                self._flush()
            self._text.append(content)
            return
        if role not in ("user", "developer", "system"):
            raise InvalidRequest(
                f"'{path}.role' must be user, developer, system or assistant, not {role!r}", f"{path}.role"
            )
        self._flush()
        self._messages.append(Message("user" if role == "user" else "system", content))

    def _reasoning_item(self, item: Mapping[str, Any], path: str) -> None:
        texts = _reasoning_texts(item, "content", f"{path}.content") or _reasoning_texts(
            item, "summary", f"{path}.summary"
        )
        if not texts:
            return  # encrypted_content only: nothing this gateway can read
        if self._text or self._calls:
            self._flush()
        self._reasoning.append("".join(texts))

    def _flush(self) -> None:
        if self._reasoning or self._text or self._calls:
            self._messages.append(
                Message(
                    "assistant",
                    "".join(self._text),
                    tool_calls=tuple(self._calls),
                    reasoning="".join(self._reasoning),
                )
            )
        self._reasoning, self._text, self._calls = [], [], []


_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _text(content: str | list[Any], path: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        expect(part, dict, f"{path}[{i}]")
        kind = require(part, "type", str, f"{path}[{i}].type")
        if kind not in _TEXT_PARTS:
            raise InvalidRequest(
                f"content part type {kind!r} is not supported ('{path}[{i}].type'); only text parts are",
                f"{path}[{i}].type",
            )
        texts.append(require(part, "text", str, f"{path}[{i}].text"))
    return "".join(texts)


def _reasoning_texts(item: Mapping[str, Any], key: str, path: str) -> list[str]:
    parts = optional(item, key, list, path) or []
    return [_text([part], f"{path}[{i}]") for i, part in enumerate(parts)]


def _tools(raw: list[Any]) -> tuple[ToolSpec, ...]:
    tools = []
    for i, tool in enumerate(raw):
        path = f"tools[{i}]"
        expect(tool, dict, path)
        if require(tool, "type", str, f"{path}.type") != "function":
            continue  # custom, web_search, tool_search, namespace, ...: see the module docstring
        tools.append(function_spec(tool, path))
    return tuple(tools)


def _tool_choice(raw: Any) -> str:
    return parse_tool_choice(raw, nested=False)


def _session_hints(body: Mapping[str, Any], headers: Mapping[str, str]) -> dict[str, str]:
    hints = {}
    for key in ("prompt_cache_key", "user"):
        value = optional(body, key, str, key)
        if value:
            hints[key] = value
    lowered = {name.lower(): value for name, value in headers.items()}
    for key in ("session-id", "thread-id"):
        if lowered.get(key):
            hints[key] = lowered[key]
    return hints


# --- Response.


def render_response(
    events: Iterable[OutputEvent], model: str, response_id: str, created: int
) -> dict[str, object]:
    """The non-streaming `response` body: the same object `response.completed` carries."""
    stream = ResponseStream(model, response_id, created)
    for event in events:
        stream.feed(event)
    if stream.response is None:
        raise RuntimeError("output ended without a Finish event; the event source is broken")
    return stream.response


class ResponseStream:
    """Turns `OutputEvent`s into Responses SSE frames (`event: <type>\\ndata: <json>\\n\\n`).

    One output item is open at a time; an event of another kind closes it. After `Finish` (or `fail`),
    `response` holds the final response object.
    """

    def __init__(self, model: str, response_id: str, created: int) -> None:
        self._model = model
        self._id = response_id
        self._created = created
        self._sequence = 0
        self._started = False
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._open_call: int | None = None
        self.response: dict[str, object] | None = None

    def start(self) -> list[str]:
        """`response.created` and `response.in_progress`; `feed` sends them first if not sent yet."""
        if self._started:
            return []
        self._started = True
        return [
            self._frame("response.created", response=self._response("in_progress")),
            self._frame("response.in_progress", response=self._response("in_progress")),
        ]

    def feed(self, event: OutputEvent) -> list[str]:
        if self.response is not None:
            raise RuntimeError(f"output event {event!r} after the response ended; the event source is broken")
        frames = self.start()
        if isinstance(event, TextDelta):
            frames += self._text_delta(event.text)
        elif isinstance(event, ReasoningDelta):
            frames += self._reasoning_delta(event.text)
        elif isinstance(event, ToolCallStart):
            frames += self._call_start(event)
        elif isinstance(event, ToolCallArgumentsDelta):
            frames += self._call_delta(event)
        elif isinstance(event, ToolCallEnd):
            if self._open_call == event.index:
                frames += self._close()
        elif isinstance(event, Finish):
            frames += self._finish(event)
        return frames

    def fail(self, message: str) -> list[str]:
        """End the stream with `response.failed` (code `server_error`; Codex retries it)."""
        frames = self.start()
        self.response = self._response("failed", error={"code": "server_error", "message": message})
        return [*frames, self._frame("response.failed", response=self.response)]

    # Items.

    def _text_delta(self, text: str) -> list[str]:
        frames = []
        if self._open is None or self._open["type"] != "message":
            frames = self._close()
            frames += self._add(
                {"type": "message", "role": "assistant", "status": "in_progress", "content": [], "text": ""}
            )
            part = {"type": "output_text", "text": "", "annotations": []}
            frames.append(self._item_frame("response.content_part.added", content_index=0, part=part))
        assert self._open is not None
        self._open["text"] += text
        frames.append(
            self._item_frame("response.output_text.delta", content_index=0, delta=text, logprobs=[])
        )
        return frames

    def _reasoning_delta(self, text: str) -> list[str]:
        frames = []
        if self._open is None or self._open["type"] != "reasoning":
            frames = self._close()
            frames += self._add({"type": "reasoning", "summary": [], "text": ""})
            part = {"type": "summary_text", "text": ""}
            frames.append(
                self._item_frame("response.reasoning_summary_part.added", summary_index=0, part=part)
            )
        assert self._open is not None
        self._open["text"] += text
        frames.append(self._item_frame("response.reasoning_summary_text.delta", summary_index=0, delta=text))
        return frames

    def _call_start(self, event: ToolCallStart) -> list[str]:
        frames = self._close()
        item = {"type": "function_call", "call_id": event.id, "name": event.name, "arguments": ""}
        frames += self._add({**item, "status": "in_progress"})
        self._open_call = event.index
        return frames

    def _call_delta(self, event: ToolCallArgumentsDelta) -> list[str]:
        if self._open is None or self._open_call != event.index:
            raise RuntimeError(
                f"arguments for tool call {event.index} while call {self._open_call} is open; "
                "the event source is broken"
            )
        self._open["arguments"] += event.text
        return [self._item_frame("response.function_call_arguments.delta", delta=event.text)]

    def _add(self, item: dict[str, Any]) -> list[str]:
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[item["type"]]
        base = self._id.removeprefix("resp_")
        self._open = {"id": f"{prefix}_{base}_{len(self._output)}", **item}
        snapshot = {k: v for k, v in self._open.items() if k != "text"}
        return [self._frame("response.output_item.added", output_index=len(self._output), item=snapshot)]

    def _close(self) -> list[str]:
        item = self._open
        if item is None:
            return []
        frames = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": item.pop("text"), "annotations": []}
            frames.append(
                self._item_frame("response.output_text.done", content_index=0, text=part["text"], logprobs=[])
            )
            frames.append(self._item_frame("response.content_part.done", content_index=0, part=part))
            item.update(status="completed", content=[part])
        elif item["type"] == "reasoning":
            part = {"type": "summary_text", "text": item.pop("text")}
            frames.append(
                self._item_frame("response.reasoning_summary_text.done", summary_index=0, text=part["text"])
            )
            frames.append(
                self._item_frame("response.reasoning_summary_part.done", summary_index=0, part=part)
            )
            item["summary"] = [part]
        else:
            frames.append(
                self._item_frame("response.function_call_arguments.done", arguments=item["arguments"])
            )
            item["status"] = "completed"
        frames.append(self._frame("response.output_item.done", output_index=len(self._output), item=item))
        self._output.append(item)
        self._open = None
        self._open_call = None
        return frames

    def _finish(self, finish: Finish) -> list[str]:
        frames = self._close()
        usage = finish.usage
        details = {"reason": "max_output_tokens"} if finish.reason == "length" else None
        self.response = self._response(
            "incomplete" if details else "completed",
            incomplete_details=details,
            usage={
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            },
        )
        frames.append(self._frame("response.completed", response=self.response))
        return frames

    # Frames.

    def _response(self, status: str, **fields: object) -> dict[str, object]:
        response: dict[str, object] = {
            "id": self._id,
            "object": "response",
            "created_at": self._created,
            "model": self._model,
            "status": status,
            "output": list(self._output),
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }
        response.update(fields)
        return response

    def _item_frame(self, kind: str, **fields: object) -> str:
        assert self._open is not None
        return self._frame(kind, item_id=self._open["id"], output_index=len(self._output), **fields)

    def _frame(self, kind: str, **fields: object) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"
