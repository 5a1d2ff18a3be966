"""Prompt rendering: the model's chat template, tools natively or through the generic tool prompt."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.conversation import Conversation, Message, ToolCall, ToolSpec
from gateway.prompt import render_prompt

READ = ToolSpec("read", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}})


class Template:
    """A stand-in tokenizer: records what the template was given and renders ChatML."""

    def __init__(self, source: str) -> None:
        self.chat_template = source
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        self.calls.append({"messages": conversation, **kwargs})
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
        return turns + "<|im_start|>assistant\n"


def conversation(*messages: Message, tools: tuple[ToolSpec, ...] = ()) -> Conversation:
    return Conversation(model="m", messages=messages, tools=tools)


def test_plain_chat_renders_through_the_template():
    template = Template("{{ messages }}")
    text = render_prompt(conversation(Message("system", "be brief"), Message("user", "hi")), template)
    assert (
        text
        == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "tools" not in template.calls[0]


def test_templates_without_tools_get_the_generic_tool_prompt_in_the_system_message():
    template = Template("{{ messages }}")
    text = render_prompt(
        conversation(Message("system", "be brief"), Message("user", "hi"), tools=(READ,)), template
    )
    system = template.calls[0]["messages"][0]["content"]
    assert system.startswith("be brief\n\n# Tools")
    assert '{"type":"function","function":{"name":"read","description":"Read a file"' in system
    assert "<tool_call>" in text


def test_tool_calls_and_results_render_as_hermes_text_without_native_tools():
    call = ToolCall("call_1", "read", '{"path":"a.py"}')
    messages = render_messages(
        Message("user", "show a.py"),
        Message("assistant", "Reading.", tool_calls=(call,)),
        Message("tool", "print(1)", tool_call_id="call_1"),
    )
    assert (
        messages[1]["content"]
        == 'Reading.\n<tool_call>\n{"name":"read","arguments":{"path":"a.py"}}\n</tool_call>'
    )
    assert messages[2] == {
        "role": "tool",
        "content": "<tool_response>\nprint(1)\n</tool_response>",
        "tool_call_id": "call_1",
    }


def render_messages(*messages: Message) -> list[dict[str, Any]]:
    template = Template("{{ messages }}")
    render_prompt(conversation(*messages, tools=(READ,)), template)
    return template.calls[0]["messages"][1:]  # after the generated system message


def test_templates_with_tools_get_them_natively():
    template = Template("{% if tools %}{{ tools }}{% endif %}{{ messages }}")
    call = ToolCall("call_1", "read", '{"path":"a.py"}')
    render_prompt(
        conversation(Message("user", "x"), Message("assistant", "", tool_calls=(call,)), tools=(READ,)),
        template,
    )
    given = template.calls[0]
    assert given["tools"][0]["function"]["name"] == "read"
    assert given["messages"][1]["tool_calls"][0]["function"] == {
        "name": "read",
        "arguments": '{"path":"a.py"}',
    }


def test_each_turn_extends_the_previous_prompt_with_the_real_smollm2_template(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    from tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    first = conversation(Message("user", "show a.py"), tools=(READ,))
    reply = 'Reading.\n<tool_call>\n{"name":"read","arguments":{"path":"a.py"}}\n</tool_call>'
    call = ToolCall("call_1", "read", '{"path":"a.py"}')
    second = conversation(
        *first.messages,
        Message("assistant", "Reading.", tool_calls=(call,)),
        Message("tool", "print(1)", tool_call_id="call_1"),
        tools=(READ,),
    )
    turn1, turn2 = render_prompt(first, tokenizer), render_prompt(second, tokenizer)
    assert turn2.startswith(turn1 + reply + "<|im_end|>\n")


@pytest.mark.parametrize("content", ["hi", "héllo 你好 🙂"])
def test_string_content_round_trips(content):
    template = Template("")
    assert content in render_prompt(conversation(Message("user", content)), template)
