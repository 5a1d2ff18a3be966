"""The Anthropic Messages adapter, driven with the request shapes and SSE minimums recorded in clients.md §3.

Responses go through the official `anthropic` SDK offline (an `httpx2.MockTransport` serves the rendered
JSON or SSE), so what the SDK accepts here is what a real client parses.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import Message as SDKMessage
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from gateway.anthropic_api import (
    BILLING_HEADER_PREFIX,
    InvalidRequest,
    MessageStream,
    error_body,
    error_frame,
    parse_messages_request,
    render_message,
)
from gateway.conversation import (
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
    Usage,
)

BILLING = f"{BILLING_HEADER_PREFIX}: cc_version=2.1.197.123; cc_entrypoint=sdk-cli;"
IDENTITY = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
MAIN_PROMPT = "You are an interactive agent that helps users with software engineering tasks."
REMINDER = "<system-reminder>\nToday's date is 2026-11-30.\n</system-reminder>"
AGENTS = "Available agent types for the Agent tool: Explore, general-purpose."
EPHEMERAL = {"type": "ephemeral"}
USER_ID = json.dumps({"device_id": "ab" * 32, "account_uuid": "", "session_id": "168ee0e1-0e27-4ca7"})
BASH_TOOL: dict[str, Any] = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
        "required": ["command"],
    },
}


def claude_code_request(messages: list[Any], **overrides: Any) -> dict[str, Any]:
    """A Claude Code `-p` body, in wire key order (clients.md §3.3)."""
    body: dict[str, Any] = {
        "model": "claude-opus-4-8",
        "messages": messages,
        "system": [
            {"type": "text", "text": BILLING},
            {"type": "text", "text": IDENTITY, "cache_control": EPHEMERAL},
            {"type": "text", "text": MAIN_PROMPT, "cache_control": EPHEMERAL},
        ],
        "tools": [BASH_TOOL],
        "metadata": {"user_id": USER_ID},
        "max_tokens": 64000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }
    body.update(overrides)
    return body


FIRST_TURN = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": REMINDER},
            {"type": "text", "text": "say hi", "cache_control": EPHEMERAL},
        ],
    },
    {"role": "system", "content": AGENTS},
]


# ------------------------------------------------------------------------------------------------------------
# Parsing


def test_first_turn() -> None:
    """Claude Code's first request: billing block dropped, system role kept in place, hints parsed."""
    conversation = parse_messages_request(claude_code_request(FIRST_TURN))
    assert conversation.model == "claude-opus-4-8"
    assert conversation.messages == (
        Message(role="system", content=f"{IDENTITY}\n\n{MAIN_PROMPT}"),
        Message(role="user", content=f"{REMINDER}\n\nsay hi"),
        Message(role="system", content=AGENTS),
    )
    assert conversation.tools == (ToolSpec("Bash", "Run a shell command.", BASH_TOOL["input_schema"]),)
    assert conversation.max_output_tokens == 64000
    assert conversation.stream is True
    assert conversation.tool_choice == "auto"
    assert conversation.session_hints == {"metadata.user_id": USER_ID}
    assert (conversation.temperature, conversation.top_p, conversation.top_k, conversation.stop) == (
        None,
        None,
        None,
        (),
    )


def test_billing_header_differs_but_conversation_does_not() -> None:
    """Two conversations that differ only in the billing hash parse to the same messages."""
    other = claude_code_request(FIRST_TURN)
    other["system"][0]["text"] = BILLING.replace("123", "9f0")
    assert parse_messages_request(other) == parse_messages_request(claude_code_request(FIRST_TURN))


def test_billing_header_only_first_match_dropped() -> None:
    body = claude_code_request(FIRST_TURN, system=[{"type": "text", "text": BILLING}] * 2)
    assert parse_messages_request(body).messages[0] == Message(role="system", content=BILLING)


def test_second_turn_extends_first() -> None:
    """Turn 2 re-serialises the old single-block user message as a string and moves cache_control."""
    second = [
        {"role": "user", "content": [{"type": "text", "text": REMINDER}, {"type": "text", "text": "say hi"}]},
        {"role": "system", "content": AGENTS},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": [{"type": "text", "text": "and again", "cache_control": EPHEMERAL}]},
    ]
    first = parse_messages_request(claude_code_request(FIRST_TURN)).messages
    turn2 = parse_messages_request(claude_code_request(second)).messages
    assert turn2[: len(first)] == first
    assert turn2[len(first) :] == (
        Message(role="assistant", content="Hi!"),
        Message(role="user", content="and again"),
    )

    third = [*second[:3], {"role": "user", "content": "and again"}]
    assert parse_messages_request(claude_code_request(third)).messages == turn2


@pytest.mark.parametrize("role", ["user", "assistant", "system"])
def test_string_and_single_text_block_are_identical(role: str) -> None:
    as_string = claude_code_request([{"role": role, "content": "x y"}])
    as_block = claude_code_request([{"role": role, "content": [{"type": "text", "text": "x y"}]}])
    assert parse_messages_request(as_string) == parse_messages_request(as_block)


def test_tool_loop() -> None:
    """tool_use becomes a ToolCall (compact JSON, client key order); results become tool messages."""
    messages = [
        {"role": "user", "content": "run it"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should run two commands.", "signature": ""},
                {"type": "text", "text": "Running a tool."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "Bash",
                    "input": {"description": "Print hi", "command": "echo hi — é"},
                },
                {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "false"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"tool_use_id": "toolu_1", "type": "tool_result", "content": "hi", "is_error": False},
                {
                    "tool_use_id": "toolu_2",
                    "type": "tool_result",
                    "content": [{"type": "text", "text": "exit 1"}, {"type": "text", "text": "stderr"}],
                    "is_error": True,
                    "cache_control": EPHEMERAL,
                },
                {"type": "text", "text": "keep going"},
            ],
        },
    ]
    parsed = parse_messages_request(claude_code_request(messages)).messages
    assert parsed[2] == Message(
        role="assistant",
        content="Running a tool.",
        reasoning="I should run two commands.",
        tool_calls=(
            ToolCall("toolu_1", "Bash", '{"description":"Print hi","command":"echo hi — é"}'),
            ToolCall("toolu_2", "Bash", '{"command":"false"}'),
        ),
    )
    assert parsed[3:] == (
        Message(role="tool", content="hi", tool_call_id="toolu_1"),
        Message(role="tool", content="exit 1\n\nstderr", tool_call_id="toolu_2", is_error=True),
        Message(role="user", content="keep going"),
    )


def test_tool_results_only_add_no_user_message() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
    ]
    parsed = parse_messages_request(claude_code_request(messages)).messages
    assert parsed[-2].tool_calls == (ToolCall("t", "Bash", "{}"),)
    assert parsed[-1] == Message(role="tool", content="", tool_call_id="t")


def test_redacted_thinking_dropped() -> None:
    assistant = {
        "role": "assistant",
        "content": [{"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "ok"}],
    }
    parsed = parse_messages_request(claude_code_request([{"role": "user", "content": "q"}, assistant]))
    assert parsed.messages[-1] == Message(role="assistant", content="ok")


def test_sampling_fields_and_tool_choice() -> None:
    body = claude_code_request(
        [{"role": "user", "content": "q"}],
        system="Be brief.",
        temperature=1,
        top_p=0.9,
        top_k=40,
        stop_sequences=["</done>"],
        tool_choice={"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
    )
    del body["stream"]
    conversation = parse_messages_request(body)
    assert conversation.messages[0] == Message(role="system", content="Be brief.")
    assert (conversation.temperature, conversation.top_p, conversation.top_k) == (1.0, 0.9, 40)
    assert conversation.stop == ("</done>",)
    assert conversation.tool_choice == "Bash"
    assert conversation.stream is False


@pytest.mark.parametrize(("choice", "expected"), [("auto", "auto"), ("any", "required"), ("none", "none")])
def test_tool_choice_types(choice: str, expected: str) -> None:
    body = claude_code_request(FIRST_TURN, tool_choice={"type": choice})
    assert parse_messages_request(body).tool_choice == expected


def _user(content: object) -> list[dict[str, object]]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        pytest.param([], "body: expected an object", id="not-an-object"),
        pytest.param({"max_tokens": 1, "messages": _user("q")}, "model: field required", id="no-model"),
        pytest.param(
            {"model": "m", "messages": _user("q")}, "max_tokens: field required", id="no-max-tokens"
        ),
        pytest.param(
            {"model": "m", "max_tokens": True, "messages": _user("q")}, "max_tokens: expected an integer"
        ),
        pytest.param(
            {"model": "m", "max_tokens": 0, "messages": _user("q")}, "max_tokens: must be at least 1"
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": []}, "messages: must not be empty", id="empty"
        ),
        pytest.param({"model": "m", "max_tokens": 1, "messages": "hi"}, "messages: expected an array"),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": [{"role": "robot", "content": "q"}]},
            "messages[0].role: unknown role 'robot'",
            id="unknown-role",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": [{"content": "q"}]},
            "messages[0].role: field required",
            id="no-role",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": _user(42)},
            "messages[0].content: expected an array, got int",
            id="content-int",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": _user([{"type": "text"}])},
            "messages[0].content[0].text: field required",
            id="text-missing",
        ),
        pytest.param(
            {
                "model": "m",
                "max_tokens": 1,
                "messages": _user([{"type": "image", "source": {"type": "base64", "data": ""}}]),
            },
            "messages[0].content[0]: image content is not supported",
            id="image",
        ),
        pytest.param(
            {
                "model": "m",
                "max_tokens": 1,
                "messages": _user([{"type": "tool_result", "tool_use_id": 7, "content": "x"}]),
            },
            "messages[0].content[0].tool_use_id: expected a string, got int",
            id="tool-use-id-int",
        ),
        pytest.param(
            {
                "model": "m",
                "max_tokens": 1,
                "messages": _user(
                    [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "image", "source": {}}],
                        }
                    ]
                ),
            },
            "messages[0].content[0].content[0]: image content is not supported",
            id="image-in-tool-result",
        ),
        pytest.param(
            {
                "model": "m",
                "max_tokens": 1,
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "B"}]}
                ],
            },
            "messages[0].content[0].input: field required",
            id="tool-use-no-input",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": _user([{"type": "tool_use", "id": "t"}])},
            "messages[0].content[0].type: unsupported content block type 'tool_use' in user content",
            id="tool-use-in-user",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": _user("q"), "system": [{"type": "image"}]},
            "system[0]: image content is not supported",
            id="system-image",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": _user("q"), "tools": [{"name": "x"}]},
            "tools[0].input_schema: field required",
            id="tool-no-schema",
        ),
        pytest.param(
            {
                "model": "m",
                "max_tokens": 1,
                "messages": _user("q"),
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools[0].type: server tool 'web_search_20250305' is not supported",
            id="server-tool",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": _user("q"), "tool_choice": {"type": "maybe"}},
            "tool_choice.type: unknown value 'maybe'",
            id="tool-choice",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": _user("q"), "temperature": "hot"},
            "temperature: expected a number, got str",
            id="temperature",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": _user("q"), "stop_sequences": ["a", 1]},
            "stop_sequences[1]: expected a string, got int",
            id="stop-sequences",
        ),
        pytest.param(
            {"model": "m", "max_tokens": 1, "messages": _user("q"), "metadata": {"user_id": 5}},
            "metadata.user_id: expected a string, got int",
            id="user-id",
        ),
    ],
)
def test_invalid_requests(body: object, message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_messages_request(body)
    assert caught.value.message.startswith(message), caught.value.message


# ------------------------------------------------------------------------------------------------------------
# Rendering and streaming, checked through the SDK


TOOL_TURN: list[OutputEvent] = [
    ReasoningDelta("Let me "),
    ReasoningDelta("check."),
    TextDelta("Running "),
    TextDelta("a tool."),
    ToolCallStart(0, "toolu_1", "Bash"),
    ToolCallArgumentsDelta(0, '{"command": "echo hi", "desc'),
    ToolCallArgumentsDelta(0, 'ription": "Print hi"}'),
    ToolCallEnd(0),
    ToolCallStart(1, "toolu_2", "Read"),
    ToolCallArgumentsDelta(1, '{"path": "/tmp/é"}'),
    ToolCallEnd(1),
    Finish("tool_calls", Usage(prompt_tokens=1000, completion_tokens=42, cached_tokens=768)),
]
TEXT_TURN: list[OutputEvent] = [
    TextDelta("Hi"),
    TextDelta(" there"),
    Finish(
        "stop_sequence",
        Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=0),
        stop_sequence="</done>",
    ),
]


def sdk_client(events: list[OutputEvent], *, error: str | None = None) -> anthropic.Anthropic:
    """An SDK client whose transport answers with `render_message` or `MessageStream` output for `events`."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        if not body.get("stream"):
            return httpx2.Response(200, json=render_message(events, body["model"], "msg_gw_1"))
        stream = MessageStream(body["model"], "msg_gw_1")
        frames = stream.start(prompt_tokens=1000, cached_tokens=768)
        for event in events:
            frames += stream.feed(event)
            if error is not None and isinstance(event, TextDelta):
                frames.append(error_frame(error, "overloaded_error"))
                break
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content="".join(frames))

    transport = httpx2.MockTransport(handler)
    return anthropic.Anthropic(
        api_key="sk-test",
        base_url="http://gateway",
        http_client=httpx2.Client(transport=transport),
        max_retries=0,
    )


REQUEST: dict[str, Any] = {
    "model": "gw-model",
    "max_tokens": 100,
    "messages": [{"role": "user", "content": "hi"}],
}


def test_render_tool_turn() -> None:
    message = sdk_client(TOOL_TURN).messages.create(**REQUEST)
    assert [block.to_dict() for block in message.content] == [
        {"type": "thinking", "thinking": "Let me check.", "signature": ""},
        {"type": "text", "text": "Running a tool."},
        {
            "type": "tool_use",
            "id": "toolu_1",
            "name": "Bash",
            "input": {"command": "echo hi", "description": "Print hi"},
        },
        {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"path": "/tmp/é"}},
    ]
    assert (message.id, message.model, message.stop_reason, message.stop_sequence) == (
        "msg_gw_1",
        "gw-model",
        "tool_use",
        None,
    )
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (
        232,
        768,
        0,
    )
    assert usage.output_tokens == 42


@pytest.mark.parametrize(
    ("reason", "expected"),
    [("stop", "end_turn"), ("length", "max_tokens"), ("stop_sequence", "stop_sequence")],
)
def test_render_stop_reasons(reason: Any, expected: str) -> None:
    finish = Finish(reason, Usage(1, 1, 0), stop_sequence="</done>" if reason == "stop_sequence" else None)
    rendered = SDKMessage.model_validate(render_message([TextDelta("x"), finish], "m", "msg"))
    assert rendered.stop_reason == expected
    assert rendered.stop_sequence == ("</done>" if reason == "stop_sequence" else None)


@pytest.mark.parametrize("arguments", ['{"command": "echo', "[1, 2]"])
def test_render_invalid_tool_arguments_kept_raw(arguments: str) -> None:
    events: list[OutputEvent] = [
        ToolCallStart(0, "toolu_1", "Bash"),
        ToolCallArgumentsDelta(0, arguments),
        ToolCallEnd(0),
        Finish("tool_calls", Usage(1, 1, 0)),
    ]
    rendered = SDKMessage.model_validate(render_message(events, "m", "msg"))
    assert rendered.content[0].to_dict()["input"] == {"raw": arguments}


def test_render_needs_finish() -> None:
    with pytest.raises(ValueError, match="Finish"):
        render_message([TextDelta("x")], "m", "msg")


@pytest.mark.parametrize("events", [TOOL_TURN, TEXT_TURN], ids=["tool-turn", "text-turn"])
def test_stream_accumulates_to_rendered_message(events: list[OutputEvent]) -> None:
    """The SDK's stream accumulator rebuilds exactly the non-streaming answer."""
    client = sdk_client(events)
    with client.messages.stream(**REQUEST) as stream:
        final = stream.get_final_message()
    rendered = client.messages.create(**REQUEST)
    assert [block.to_dict() for block in final.content] == [block.to_dict() for block in rendered.content]
    assert final.usage == rendered.usage
    assert (final.id, final.stop_reason, final.stop_sequence) == (
        rendered.id,
        rendered.stop_reason,
        rendered.stop_sequence,
    )


def parse_frames(frames: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Split SSE frames into (event line, data), checking the `event:` line matches the data's type."""
    parsed = []
    for frame in frames:
        event_line, data_line, *rest = frame.split("\n")
        assert rest == ["", ""] and event_line.startswith("event: ") and data_line.startswith("data: "), frame
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line.removeprefix("event: ") == data["type"]
        parsed.append((data["type"], data))
    return parsed


def test_stream_frames_are_sdk_events_in_block_order() -> None:
    """Every frame but ping validates as an SDK event; each block is started, delta'd and stopped in order."""
    stream = MessageStream("gw-model", "msg_gw_1")
    frames = [frame for event in TOOL_TURN for frame in stream.feed(event)]
    adapter: TypeAdapter[RawMessageStreamEvent] = TypeAdapter(RawMessageStreamEvent)
    parsed = parse_frames(frames)
    for kind, data in parsed:
        if kind != "ping":
            adapter.validate_python(data)
    summary = [
        (kind, data.get("index"), (data.get("delta") or data.get("content_block") or {}).get("type"))
        for kind, data in parsed
    ]
    assert summary == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    message_delta = parsed[-2][1]
    assert message_delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert message_delta["usage"]["input_tokens"] == 232


def test_stream_without_start_has_zero_input_hint() -> None:
    stream = MessageStream("m", "msg")
    first = parse_frames(stream.feed(TextDelta("x")))
    assert first[0][1]["message"]["usage"]["input_tokens"] == 0
    assert [kind for kind, _ in first] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
    ]


def test_stream_empty_text_opens_no_block() -> None:
    stream = MessageStream("m", "msg")
    assert [kind for kind, _ in parse_frames(stream.feed(TextDelta("")))] == ["message_start", "ping"]
    finish = parse_frames(stream.feed(Finish("stop", Usage(1, 0, 0))))
    assert [kind for kind, _ in finish] == ["message_delta", "message_stop"]


def test_stream_rejects_misuse() -> None:
    stream = MessageStream("m", "msg")
    stream.feed(ToolCallStart(0, "t", "Bash"))
    with pytest.raises(RuntimeError, match="not the open content block"):
        stream.feed(ToolCallArgumentsDelta(1, "{}"))
    stream.feed(Finish("tool_calls", Usage(1, 1, 0)))
    with pytest.raises(RuntimeError, match="after Finish"):
        stream.feed(TextDelta("late"))
    with pytest.raises(RuntimeError, match="twice"):
        stream.start()


def test_stream_error_frame_raises_in_sdk() -> None:
    client = sdk_client(TEXT_TURN, error="backend overloaded")
    with (
        pytest.raises(anthropic.APIStatusError, match="backend overloaded"),
        client.messages.stream(**REQUEST) as stream,
    ):
        stream.get_final_message()


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (422, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_body(status: int, error_type: str) -> None:
    assert error_body(status, "boom") == {"type": "error", "error": {"type": error_type, "message": "boom"}}
