"""The three client APIs behind one interface: parse a request, render a response or a stream, an error.

`Api` hides what differs between Anthropic Messages, OpenAI Chat Completions and OpenAI Responses
(request shapes, stream framing, how a stream reports a failure, error envelopes) so that the request
path in `gateway.app` is written once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from gateway import anthropic_api, openai_chat, openai_responses
from gateway.conversation import Conversation, OutputEvent


class Renderer(Protocol):
    def start(self, prompt_tokens: int, cached_tokens: int) -> list[str]: ...

    def feed(self, event: OutputEvent) -> list[str]: ...

    def fail(self, message: str) -> list[str]: ...


class Api(Protocol):
    name: str
    invalid_request: tuple[type[Exception], ...]

    def parse(self, body: Any, headers: Mapping[str, str]) -> Conversation: ...

    def response(self, events: list[OutputEvent], model: str) -> dict[str, Any]: ...

    def stream(self, body: Any, model: str) -> Renderer: ...

    def error(self, status: int, message: str) -> dict[str, Any]: ...


##### Anthropic Messages #####


class _AnthropicRenderer:
    def __init__(self, model: str) -> None:
        self._stream = anthropic_api.MessageStream(model, f"msg_{uuid.uuid4().hex}")

    def start(self, prompt_tokens: int, cached_tokens: int) -> list[str]:
        return self._stream.start(prompt_tokens, cached_tokens)

    def feed(self, event: OutputEvent) -> list[str]:
        return self._stream.feed(event)

    def fail(self, message: str) -> list[str]:
        return [anthropic_api.error_frame(message, "api_error")]


class AnthropicMessages:
    name = "anthropic"
    invalid_request: tuple[type[Exception], ...] = (anthropic_api.InvalidRequest,)

    def parse(self, body: Any, headers: Mapping[str, str]) -> Conversation:
        return anthropic_api.parse_messages_request(body)

    def response(self, events: list[OutputEvent], model: str) -> dict[str, Any]:
        return dict(anthropic_api.render_message(events, model, f"msg_{uuid.uuid4().hex}"))

    def stream(self, body: Any, model: str) -> Renderer:
        return _AnthropicRenderer(model)

    def error(self, status: int, message: str) -> dict[str, Any]:
        return dict(anthropic_api.error_body(status, message))


##### OpenAI Chat Completions #####


class _ChatRenderer:
    def __init__(self, model: str, include_usage: bool) -> None:
        self._stream = openai_chat.ChatStream(
            model, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), include_usage
        )

    def start(self, prompt_tokens: int, cached_tokens: int) -> list[str]:
        return []

    def feed(self, event: OutputEvent) -> list[str]:
        return self._stream.feed(event)

    def fail(self, message: str) -> list[str]:
        # OpenAI streams report a failure as an error object in a data line, then end.
        import json

        return [f"data: {json.dumps(openai_chat.error_body(502, message))}\n\n", "data: [DONE]\n\n"]


class OpenAIChat:
    name = "chat"
    invalid_request: tuple[type[Exception], ...] = (openai_chat.InvalidRequest,)

    def parse(self, body: Any, headers: Mapping[str, str]) -> Conversation:
        return openai_chat.parse_chat_request(body)

    def response(self, events: list[OutputEvent], model: str) -> dict[str, Any]:
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        return dict(openai_chat.render_chat_completion(events, model, completion_id, int(time.time())))

    def stream(self, body: Any, model: str) -> Renderer:
        return _ChatRenderer(model, openai_chat.stream_include_usage(body))

    def error(self, status: int, message: str) -> dict[str, Any]:
        return dict(openai_chat.error_body(status, message))


##### OpenAI Responses #####


class _ResponsesRenderer:
    def __init__(self, model: str) -> None:
        self._stream = openai_responses.ResponseStream(model, f"resp_{uuid.uuid4().hex}", int(time.time()))

    def start(self, prompt_tokens: int, cached_tokens: int) -> list[str]:
        return self._stream.start()

    def feed(self, event: OutputEvent) -> list[str]:
        return self._stream.feed(event)

    def fail(self, message: str) -> list[str]:
        return self._stream.fail(message)


class OpenAIResponses:
    name = "responses"
    invalid_request: tuple[type[Exception], ...] = (openai_chat.InvalidRequest,)

    def parse(self, body: Any, headers: Mapping[str, str]) -> Conversation:
        return openai_responses.parse_responses_request(body, headers)

    def response(self, events: list[OutputEvent], model: str) -> dict[str, Any]:
        return dict(
            openai_responses.render_response(events, model, f"resp_{uuid.uuid4().hex}", int(time.time()))
        )

    def stream(self, body: Any, model: str) -> Renderer:
        return _ResponsesRenderer(model)

    def error(self, status: int, message: str) -> dict[str, Any]:
        return dict(openai_responses.error_body(status, message))
