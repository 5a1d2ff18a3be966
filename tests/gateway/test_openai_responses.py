"""Responses adapter: Codex's request shapes (clients.md §4), and output checked against the `openai` SDK."""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

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
from gateway.openai_responses import (
    InvalidRequest,
    ResponseStream,
    error_body,
    parse_responses_request,
    render_response,
)

THREAD = "019a6b2e-7c1d-7f00-8000-000000000001"
HEADERS = {
    "session-id": THREAD,
    "thread-id": THREAD,
    "x-client-request-id": THREAD,
    "originator": "codex_exec",
}
EXEC_PARAMS = {
    "type": "object",
    "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
    "required": ["cmd"],
    "additionalProperties": False,
}
CODEX_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command in a PTY.",
        "strict": False,
        "parameters": EXEC_PARAMS,
    },
    {"type": "custom", "name": "apply_patch", "description": "Patch files.", "format": {"type": "grammar"}},
    {"type": "tool_search", "execution": "client"},
    {"type": "web_search", "external_web_access": False, "search_content_types": ["text", "image"]},
    {"type": "namespace", "name": "multi_agent_v1", "tools": []},
]


def developer(item_id: str, *texts: str) -> dict[str, Any]:
    parts = [{"type": "input_text", "text": text} for text in texts]
    return {"type": "message", "id": item_id, "role": "developer", "content": parts}


def user(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }


FIRST_INPUT = [
    developer("msg_0", "You are Codex."),
    developer("msg_1", "<skills_instructions>", "<permissions instructions>", "<tools>"),
    user("msg_2", "<environment_context>cwd</environment_context>"),
    user("msg_3", "say hi"),
]
ANSWER = {
    "type": "message",
    "status": "completed",
    "id": "msg_resp1_0",
    "role": "assistant",
    "content": [{"type": "output_text", "text": "hi", "annotations": []}],
}
REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [{"type": "summary_text", "text": "Run echo."}],
    "content": None,
    "encrypted_content": "gAAAA",
}
CALL = {
    "type": "function_call",
    "status": "completed",
    "id": "fc_1",
    "name": "exec_command",
    "arguments": '{"cmd": "echo hi"}',
    "call_id": "call_1",
}
CALL_OUTPUT = {
    "type": "function_call_output",
    "id": "fco_1",
    "call_id": "call_1",
    "output": "Chunk ID: 56e9fc\nProcess exited with code 0\nOutput:\nhi\n",
}


def codex_body(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "gpt-5.5",
        "stream": True,
        "input": items,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": THREAD,
        "text": {"verbosity": "low"},
        "client_metadata": {"thread_id": THREAD, "turn_id": "t1"},
    }


def test_first_turn() -> None:
    conversation = parse_responses_request(codex_body(FIRST_INPUT), HEADERS)
    assert conversation.model == "gpt-5.5"
    assert conversation.messages == (
        Message("system", "You are Codex."),
        Message("system", "<skills_instructions><permissions instructions><tools>"),
        Message("user", "<environment_context>cwd</environment_context>"),
        Message("user", "say hi"),
    )
    assert conversation.stream
    assert conversation.tool_choice == "auto"
    assert conversation.session_hints == {
        "prompt_cache_key": THREAD,
        "session-id": THREAD,
        "thread-id": THREAD,
    }


def test_only_function_tools_are_kept() -> None:
    """custom, tool_search, web_search and namespace tools come with every Codex request and are dropped."""
    conversation = parse_responses_request(codex_body(FIRST_INPUT))
    assert conversation.tools == (ToolSpec("exec_command", "Runs a command in a PTY.", EXEC_PARAMS),)


def test_second_turn_extends_the_first() -> None:
    first = parse_responses_request(codex_body(FIRST_INPUT))
    second = parse_responses_request(codex_body([*FIRST_INPUT, ANSWER, user("msg_4", "and again")]))
    assert second.messages[: len(first.messages)] == first.messages
    assert second.messages[len(first.messages) :] == (
        Message("assistant", "hi"),
        Message("user", "and again"),
    )


def test_tool_loop() -> None:
    """Reasoning and the call of one model turn form one assistant message; the output is a tool message."""
    first = parse_responses_request(codex_body(FIRST_INPUT))
    loop = parse_responses_request(codex_body([*FIRST_INPUT, REASONING, CALL, CALL_OUTPUT]))
    assert loop.messages[: len(first.messages)] == first.messages
    assert loop.messages[len(first.messages) :] == (
        Message(
            "assistant",
            "",
            tool_calls=(ToolCall("call_1", "exec_command", '{"cmd": "echo hi"}'),),
            reasoning="Run echo.",
        ),
        Message("tool", CALL_OUTPUT["output"], tool_call_id="call_1"),
    )


def test_assistant_turn_grouping() -> None:
    """Text after calls, or reasoning after text, starts a new assistant message (order is kept)."""
    items = [
        user("u", "go"),
        {**REASONING, "content": [{"type": "reasoning_text", "text": "full thought"}]},
        ANSWER,
        CALL,
        ANSWER,
        {**REASONING, "summary": [], "content": None},
    ]
    conversation = parse_responses_request(codex_body(items))
    assert conversation.messages[1:] == (
        Message(
            "assistant",
            "hi",
            tool_calls=(ToolCall("call_1", "exec_command", '{"cmd": "echo hi"}'),),
            reasoning="full thought",
        ),
        Message("assistant", "hi"),
    )


def test_encrypted_only_reasoning_is_skipped() -> None:
    items = [user("u", "go"), {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "x"}]
    assert parse_responses_request(codex_body(items)).messages == (Message("user", "go"),)


def test_string_and_parts_give_the_same_conversation() -> None:
    as_string = {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"},
            {"type": "function_call_output", "call_id": "c", "output": "done"},
        ],
    }
    as_parts = {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_text", "text": "done"}],
            },
        ],
    }
    assert parse_responses_request(as_string) == parse_responses_request(as_parts)
    assert parse_responses_request(as_string).messages[0] == Message("system", "be brief")


def test_string_input_and_sampling_fields() -> None:
    body = {
        "model": "m",
        "input": "hello",
        "max_output_tokens": 64,
        "temperature": 1,
        "top_p": 0.5,
        "tool_choice": {"type": "function", "name": "exec_command"},
        "user": "bob",
    }
    conversation = parse_responses_request(body, {"Session-Id": "s1"})
    assert conversation.messages == (Message("user", "hello"),)
    assert (conversation.max_output_tokens, conversation.temperature, conversation.top_p) == (64, 1.0, 0.5)
    assert conversation.tool_choice == "exec_command"
    assert conversation.session_hints == {"user": "bob", "session-id": "s1"}
    assert not conversation.stream


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"input": "x"}, "model", id="no-model"),
        pytest.param({"model": "m"}, "input", id="no-input"),
        pytest.param({"model": "m", "input": 3}, "input", id="input-type"),
        pytest.param(
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            },
            "input[0].content[0].type",
            id="image",
        ),
        pytest.param(
            {"model": "m", "input": [{"type": "additional_tools", "role": "developer", "tools": []}]},
            "input[0].type",
            id="responses-lite",
        ),
        pytest.param({"model": "m", "input": [{"type": "web_search_call"}]}, "input[0].type", id="item-type"),
        pytest.param({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role", id="role"),
        pytest.param({"model": "m", "input": [{**CALL, "arguments": {}}]}, "input[0].arguments", id="args"),
        pytest.param(
            {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
            "input[0].call_id",
            id="no-call-id",
        ),
        pytest.param({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        pytest.param({"model": "m", "input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
        pytest.param({"model": "m", "input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
    ],
)
def test_invalid_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_responses_request(body)
    assert caught.value.param == param
    assert param in caught.value.message


def test_error_body() -> None:
    assert error_body(400, "bad") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }


# --- Output.

USAGE = Usage(prompt_tokens=9000, completion_tokens=40, cached_tokens=8960)
# The SDK's union is tagged with its own discriminator marker, which pydantic does not read: pick the member
# by `type` so that a failure names the one event model that rejected the payload.
_EVENT_MODELS = typing.get_args(typing.get_args(ResponseStreamEvent)[0])
EVENT_ADAPTERS: dict[str, TypeAdapter[Any]] = {
    typing.get_args(model.model_fields["type"].annotation)[0]: TypeAdapter(model) for model in _EVENT_MODELS
}


STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def validate_event(payload: dict[str, Any]) -> Any:
    event = EVENT_ADAPTERS[payload["type"]].validate_python(payload)
    assert type(STREAM_EVENT.validate_python(payload)) is type(event)
    return event


TEXT_EVENTS: list[OutputEvent] = [
    ReasoningDelta("Say "),
    ReasoningDelta("hi."),
    TextDelta("h"),
    TextDelta("i"),
    Finish("stop", USAGE),
]
CALL_EVENTS: list[OutputEvent] = [
    TextDelta("Running it."),
    ToolCallStart(0, "call_a", "exec_command"),
    ToolCallArgumentsDelta(0, '{"cmd": '),
    ToolCallArgumentsDelta(0, '"echo hi"}'),
    ToolCallEnd(0),
    ToolCallStart(1, "call_b", "exec_command"),
    ToolCallArgumentsDelta(1, '{"cmd": "pwd"}'),
    Finish("tool_calls", USAGE),
]


def stream(events: list[OutputEvent]) -> list[dict[str, Any]]:
    """Feed the events; check each frame's `event:` line and its SDK type; return the payloads."""
    response_stream = ResponseStream("gpt-5.5", "resp_abc", 1700000000)
    payloads = []
    for event in events:
        for frame in response_stream.feed(event):
            event_line, data_line, blank, end = frame.split("\n")
            assert (blank, end) == ("", "")
            payload = json.loads(data_line.removeprefix("data: "))
            assert event_line == f"event: {payload['type']}"
            validate_event(payload)
            payloads.append(payload)
    return payloads


def test_stream_text() -> None:
    payloads = stream(TEXT_EVENTS)
    types = [p["type"] for p in payloads]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    done = [p["item"] for p in payloads if p["type"] == "response.output_item.done"]
    assert done[0]["summary"] == [{"type": "summary_text", "text": "Say hi."}]
    assert done[1]["content"] == [{"type": "output_text", "text": "hi", "annotations": []}]
    completed = Response.model_validate(payloads[-1]["response"])
    assert completed.status == "completed"
    assert completed.output_text == "hi"
    assert completed.usage is not None
    assert completed.usage.input_tokens_details.cached_tokens == 8960
    assert completed.usage.total_tokens == 9040


def test_stream_tool_calls() -> None:
    """Every item ends with output_item.done (Codex ignores response.completed's output)."""
    payloads = stream(CALL_EVENTS)
    done = [p for p in payloads if p["type"] == "response.output_item.done"]
    assert [p["output_index"] for p in done] == [0, 1, 2]
    calls = [p["item"] for p in done[1:]]
    assert [(c["call_id"], c["name"], c["arguments"], c["status"]) for c in calls] == [
        ("call_a", "exec_command", '{"cmd": "echo hi"}', "completed"),
        ("call_b", "exec_command", '{"cmd": "pwd"}', "completed"),
    ]
    deltas = [p["delta"] for p in payloads if p["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"cmd": ', '"echo hi"}', '{"cmd": "pwd"}']
    arguments_done = [p for p in payloads if p["type"] == "response.function_call_arguments.done"]
    assert [p["item_id"] for p in arguments_done] == [c["id"] for c in calls]
    assert payloads[-1]["type"] == "response.completed"


def test_stream_items_round_trip() -> None:
    """What Codex sends back (the done items) parses to the assistant message the model produced."""
    payloads = stream([ReasoningDelta("think"), *CALL_EVENTS])
    items = [p["item"] for p in payloads if p["type"] == "response.output_item.done"]
    conversation = parse_responses_request({"model": "m", "input": [user("u", "go"), *items]})
    assert conversation.messages[1] == Message(
        "assistant",
        "Running it.",
        tool_calls=(
            ToolCall("call_a", "exec_command", '{"cmd": "echo hi"}'),
            ToolCall("call_b", "exec_command", '{"cmd": "pwd"}'),
        ),
        reasoning="think",
    )


def test_render_response() -> None:
    body = render_response(CALL_EVENTS, "gpt-5.5", "resp_abc", 1700000000)
    response = Response.model_validate(body)
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
    assert response.output_text == "Running it."
    assert response.usage is not None and response.usage.output_tokens == 40


def test_length_completes_as_incomplete() -> None:
    """A cut at max_output_tokens still ends with response.completed: Codex retries response.incomplete."""
    payloads = stream([TextDelta("partial"), Finish("length", USAGE)])
    assert payloads[-1]["type"] == "response.completed"
    response = Response.model_validate(payloads[-1]["response"])
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


def test_fail() -> None:
    response_stream = ResponseStream("m", "resp_x", 0)
    frames = response_stream.feed(TextDelta("a")) + response_stream.fail("backend died")
    payload = json.loads(frames[-1].split("\n")[1].removeprefix("data: "))
    event = validate_event(payload)
    assert event.type == "response.failed"
    assert event.response.error.code == "server_error"


def test_render_without_finish_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="without a Finish"):
        render_response([TextDelta("x")], "m", "resp_x", 0)


def test_events_after_finish_are_a_bug() -> None:
    response_stream = ResponseStream("m", "resp_x", 0)
    response_stream.feed(Finish("stop", USAGE))
    with pytest.raises(RuntimeError, match="after the response ended"):
        response_stream.feed(TextDelta("late"))
