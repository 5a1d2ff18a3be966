"""Rendering a `Conversation` into the served model's prompt text with its chat template.

The template is the model's own HuggingFace Jinja template (`tokenizer.chat_template`), given the
messages and, when the template uses them, the tools. A template that never mentions `tools` (SmolLM2's
ChatML) gets Loom's generic tool prompt instead, the Hermes / Qwen convention models of this family
were trained on:

- the system message is followed by a `# Tools` section listing each tool's JSON schema inside
  `<tools></tools>` and asking for calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant message's tool calls are appended to its text in that same form, so a later turn
  renders the call exactly as the model wrote it;
- a tool result is a `tool` message wrapped in `<tool_response></tool_response>`.

JSON is compact with the client's key order (`separators=(",", ":")`): the same tools and calls give
the same text on every turn, so each turn's prompt extends the previous one.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from gateway.conversation import Conversation, Message, ToolCall, ToolSpec

GENERIC_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ChatTemplate(Protocol):
    chat_template: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def render_prompt(conversation: Conversation, tokenizer: ChatTemplate) -> str:
    """The prompt text, ending with the template's generation prompt for the assistant."""
    native_tools = "tools" in str(tokenizer.chat_template or "")
    messages = [_message(m, native_tools) for m in conversation.messages]
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if conversation.tools and native_tools:
        kwargs["tools"] = [_schema(tool) for tool in conversation.tools]
    elif conversation.tools:
        messages = _with_generic_tool_prompt(messages, conversation.tools)
    return str(tokenizer.apply_chat_template(messages, **kwargs))


def _schema(tool: ToolSpec) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def _with_generic_tool_prompt(
    messages: list[dict[str, Any]], tools: tuple[ToolSpec, ...]
) -> list[dict[str, Any]]:
    section = GENERIC_TOOL_PROMPT.format(tools="\n".join(compact(_schema(t)) for t in tools))
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{section}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def _message(message: Message, native_tools: bool) -> dict[str, Any]:
    if message.role == "tool":
        content = message.content if native_tools else f"<tool_response>\n{message.content}\n</tool_response>"
        return {"role": "tool", "content": content, "tool_call_id": message.tool_call_id}
    if message.role != "assistant" or not message.tool_calls:
        return {"role": message.role, "content": message.content}
    if native_tools:
        calls = [_native_call(call) for call in message.tool_calls]
        return {"role": "assistant", "content": message.content, "tool_calls": calls}
    rendered = "".join(_hermes_call(call) for call in message.tool_calls)
    text = f"{message.content}\n{rendered}" if message.content else rendered
    return {"role": "assistant", "content": text}


def _hermes_call(call: ToolCall) -> str:
    return f'<tool_call>\n{{"name":{compact(call.name)},"arguments":{call.arguments}}}\n</tool_call>'


def _native_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
