"""Chat Completions adapter: request parsing, and output checked against the official `openai` SDK types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

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
from gateway.openai_chat import (
    ChatStream,
    InvalidRequest,
    error_body,
    parse_chat_request,
    render_chat_completion,
    stream_include_usage,
)

ARGS = '{"cmd": "echo hi", "workdir": "/tmp"}'
TOOL = {
    "type": "function",
    "function": {
        "name": "exec_command",
        "description": "Run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
}


def tool_loop_body() -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": [
            {"role": "developer", "content": "You are a coding agent."},
            {"role": "user", "content": [{"type": "text", "text": "run "}, {"type": "text", "text": "it"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "exec_command", "arguments": ARGS},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "hi\n"},
        ],
        "tools": [TOOL],
        "tool_choice": "auto",
        "max_completion_tokens": 256,
        "temperature": 0.2,
        "top_p": 0.9,
        "stop": ["</s>", "END"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "alice",
        "prompt_cache_key": "thread-1",
    }


def test_tool_loop_request() -> None:
    conversation = parse_chat_request(tool_loop_body())
    assert conversation.messages == (
        Message("system", "You are a coding agent."),
        Message("user", "run it"),
        Message("assistant", "", tool_calls=(ToolCall("call_1", "exec_command", ARGS),)),
        Message("tool", "hi\n", tool_call_id="call_1"),
    )
    assert conversation.tools == (
        ToolSpec("exec_command", "Run a command", TOOL["function"]["parameters"]),  # type: ignore[index]
    )
    assert conversation.max_output_tokens == 256
    assert (conversation.temperature, conversation.top_p) == (0.2, 0.9)
    assert conversation.stop == ("</s>", "END")
    assert conversation.stream
    assert conversation.tool_choice == "auto"
    assert conversation.session_hints == {"user": "alice", "prompt_cache_key": "thread-1"}
    assert stream_include_usage(tool_loop_body())


def test_arguments_are_kept_byte_for_byte() -> None:
    """Key order and spacing of tool-call arguments matter for prefix caching."""
    conversation = parse_chat_request(tool_loop_body())
    assert conversation.messages[2].tool_calls[0].arguments == ARGS


def test_string_and_text_parts_give_the_same_conversation() -> None:
    as_string = {
        "model": "m",
        "messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "hi"}],
    }
    as_parts = {
        "model": "m",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
    }
    assert parse_chat_request(as_string) == parse_chat_request(as_parts)


def test_defaults() -> None:
    conversation = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert conversation.max_output_tokens is None
    assert conversation.stop == ()
    assert not conversation.stream
    assert conversation.tool_choice == "auto"
    assert conversation.session_hints == {}
    assert not stream_include_usage({"model": "m", "messages": []})


@pytest.mark.parametrize(
    ("update", "choice"),
    [
        pytest.param({"tool_choice": "none"}, "none", id="none"),
        pytest.param({"tool_choice": "required"}, "required", id="required"),
        pytest.param({"tool_choice": {"type": "function", "function": {"name": "ls"}}}, "ls", id="named"),
    ],
)
def test_tool_choice(update: dict[str, Any], choice: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **update}
    assert parse_chat_request(body).tool_choice == choice


def test_max_tokens_and_single_stop() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "stop": "\n"}
    conversation = parse_chat_request(body)
    assert conversation.max_output_tokens == 7
    assert conversation.stop == ("\n",)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"messages": [{"role": "user", "content": "hi"}]}, "model", id="no-model"),
        pytest.param({"model": "m", "messages": []}, "messages", id="no-messages"),
        pytest.param(
            {"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", id="role"
        ),
        pytest.param(
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]},
                ],
            },
            "messages[0].content[0].type",
            id="image",
        ),
        pytest.param(
            {"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"
        ),
        pytest.param(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "temperature",
            id="temperature-type",
        ),
        pytest.param(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": True},
            "max_tokens",
            id="bool-is-not-int",
        ),
        pytest.param(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search"}]},
            "tools[0].type",
            id="tool-type",
        ),
        pytest.param({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n", id="n"),
        pytest.param(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "any"},
            "tool_choice",
            id="tool-choice",
        ),
    ],
)
def test_invalid_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(body)
    assert caught.value.param == param
    assert param in caught.value.message


def test_image_error_says_what_is_refused() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    with pytest.raises(InvalidRequest, match="'image_url' is not supported"):
        parse_chat_request(body)


USAGE = Usage(prompt_tokens=100, completion_tokens=12, cached_tokens=64)
TEXT_EVENTS: list[OutputEvent] = [TextDelta("Hel"), TextDelta("lo"), Finish("stop", USAGE)]
CALL_EVENTS: list[OutputEvent] = [
    ReasoningDelta("need ls"),
    ToolCallStart(0, "call_a", "exec_command"),
    ToolCallArgumentsDelta(0, '{"cmd": '),
    ToolCallArgumentsDelta(0, '"ls"}'),
    ToolCallEnd(0),
    ToolCallStart(1, "call_b", "exec_command"),
    ToolCallArgumentsDelta(1, '{"cmd": "pwd"}'),
    ToolCallEnd(1),
    Finish("tool_calls", USAGE),
]


def test_render_text() -> None:
    body = render_chat_completion(TEXT_EVENTS, "smollm2", "chatcmpl-1", 1700000000)
    completion = ChatCompletion.model_validate(body)
    assert completion.choices[0].message.content == "Hello"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.total_tokens == 112
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 64


def test_render_tool_calls() -> None:
    body = render_chat_completion(CALL_EVENTS, "smollm2", "chatcmpl-1", 1700000000)
    completion = ChatCompletion.model_validate(body)
    message = completion.choices[0].message
    assert message.content is None
    assert message.tool_calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [  # type: ignore[union-attr]
        ("call_a", "exec_command", '{"cmd": "ls"}'),
        ("call_b", "exec_command", '{"cmd": "pwd"}'),
    ]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert body["choices"][0]["message"]["reasoning_content"] == "need ls"  # type: ignore[index]


@pytest.mark.parametrize(("reason", "expected"), [("length", "length"), ("stop_sequence", "stop")])
def test_render_finish_reasons(reason: Any, expected: str) -> None:
    body = render_chat_completion([Finish(reason, USAGE)], "m", "c", 0)
    assert ChatCompletion.model_validate(body).choices[0].finish_reason == expected


def test_render_without_finish_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="without a Finish"):
        render_chat_completion([TextDelta("x")], "m", "c", 0)


def test_arguments_before_start_are_a_bug() -> None:
    with pytest.raises(RuntimeError, match="before its ToolCallStart"):
        render_chat_completion([ToolCallArgumentsDelta(0, "{}"), Finish("stop", USAGE)], "m", "c", 0)


def stream(events: list[OutputEvent], include_usage: bool) -> list[str]:
    chat_stream = ChatStream("smollm2", "chatcmpl-1", 1700000000, include_usage)
    return [frame for event in events for frame in chat_stream.feed(event)]


def chunks(frames: list[str]) -> list[ChatCompletionChunk]:
    assert frames[-1] == "data: [DONE]\n\n"
    for frame in frames:
        assert frame.startswith("data: ") and frame.endswith("\n\n")
    return [ChatCompletionChunk.model_validate(json.loads(f[len("data: ") :])) for f in frames[:-1]]


def test_stream_text_with_usage() -> None:
    parsed = chunks(stream(TEXT_EVENTS, include_usage=True))
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parsed if c.choices) == "Hello"
    assert parsed[-2].choices[0].finish_reason == "stop"
    assert parsed[-1].choices == []
    assert parsed[-1].usage is not None
    assert parsed[-1].usage.prompt_tokens_details is not None
    assert parsed[-1].usage.prompt_tokens_details.cached_tokens == 64
    assert all(c.usage is None for c in parsed[:-1])


def test_stream_without_usage_has_no_usage_chunk() -> None:
    parsed = chunks(stream(TEXT_EVENTS, include_usage=False))
    assert parsed[-1].choices[0].finish_reason == "stop"
    assert all(c.choices for c in parsed)


def test_stream_tool_calls() -> None:
    """Each call opens with index, id and name, then streams argument fragments under its index."""
    parsed = chunks(stream(CALL_EVENTS, include_usage=False))
    calls: dict[int, dict[str, str]] = {}
    for chunk in parsed:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                assert delta.function is not None and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            assert delta.function is not None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert calls == {
        0: {"id": "call_a", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        1: {"id": "call_b", "name": "exec_command", "arguments": '{"cmd": "pwd"}'},
    }
    assert parsed[-1].choices[0].finish_reason == "tool_calls"


def test_stream_after_finish_is_a_bug() -> None:
    chat_stream = ChatStream("m", "c", 0)
    chat_stream.feed(Finish("stop", USAGE))
    with pytest.raises(RuntimeError, match="after Finish"):
        chat_stream.feed(TextDelta("late"))


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (429, "rate_limit_error"),
        (503, "server_error"),
    ],
)
def test_error_body(status: int, kind: str) -> None:
    body = error_body(status, "nope", "messages[0]")
    assert body == {"error": {"message": "nope", "type": kind, "param": "messages[0]", "code": None}}
