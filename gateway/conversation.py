"""The gateway's API-neutral view of a request and of a model's output.

Each API adapter (Anthropic Messages, OpenAI Responses, OpenAI Chat Completions) parses its request into a
`Conversation` and renders the model's output from `OutputEvent`s; everything between (session identity,
canonicalisation, chat template, tokenization, backend) sees only these types. Tool-call arguments are
JSON text kept exactly as the client sent them (key order matters for prefix caching).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, object]
    """JSON Schema of the arguments."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text of the arguments, as the client sent it (or as the model produced it)."""


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str = ""
    """Text content; content blocks of one message are joined in order."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Assistant messages: the calls the model made."""
    tool_call_id: str | None = None
    """Tool messages: the call this result answers."""
    reasoning: str = ""
    """Assistant thinking text (Anthropic `thinking` blocks, Responses `reasoning` items)."""
    is_error: bool = False
    """Tool messages: the tool failed (Anthropic `is_error`)."""


@dataclass(frozen=True, slots=True)
class Conversation:
    model: str
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    tool_choice: str = "auto"
    """"auto", "none", "required" or a tool name."""
    session_hints: dict[str, str] = field(default_factory=dict)
    """What the API said about the session (e.g. metadata.user_id, prompt_cache_key)."""


# The model's output, as the streaming parser emits it and every adapter renders it.


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    """Position among this response's tool calls."""
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int


FinishReason = Literal["stop", "length", "tool_calls", "stop_sequence"]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Finish:
    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None


OutputEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd | Finish
