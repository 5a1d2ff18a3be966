"""The gateway over real HTTP in front of a live engine (tiny model), driven by the official SDKs."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from gateway.app import GatewayConfig, create_app
from tests.engine.test_server import base_url, cache_dir, loaded, runner  # noqa: F401 (fixtures)
from tests.serving import running


def dead_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gateway_url(base_url: str, cache_dir: Path) -> Iterator[str]:  # noqa: F811
    # A dead backend listed first: sessions placed there must fail over without the client noticing.
    config = GatewayConfig(
        backends=(dead_url(), base_url),
        served_model="loom-tiny",
        max_output_tokens=16,
        max_body_bytes=200_000,
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOOM_CACHE_DIR", str(cache_dir))
        from tokenizer import load_tokenizer

        tokenizer = load_tokenizer("smollm2")
    with running(create_app(config, tokenizer)) as url:
        yield url


def anthropic_client(url: str, session: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=url, api_key="x", default_headers={"x-loom-session": session}, max_retries=0
    )


def test_anthropic_messages_two_turns_reuse_the_cache(gateway_url):
    client = anthropic_client(gateway_url, "a1")
    history = [{"role": "user", "content": "Say something about the sea."}]
    first = client.messages.create(model="loom-tiny", max_tokens=12, messages=history)
    assert first.stop_reason in ("end_turn", "max_tokens") and first.usage.output_tokens > 0
    reply = "".join(block.text for block in first.content if block.type == "text")
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the sky?"}]
    second = client.messages.create(model="loom-tiny", max_tokens=12, messages=history)
    assert second.usage.cache_read_input_tokens > 0
    stats = httpx.get(f"{gateway_url}/v1/loom/sessions/a1").json()
    assert stats["turns"] == 2 and stats["cached_tokens"] > 0
    # The second prompt reuses the first turn's prompt and generated ids (the random model's reply would
    # not survive decode + encode), so all of the first turn is a prefix of the second.
    first_turn = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    second_prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert round(stats["append_ratio"] * second_prompt) == first_turn


def test_anthropic_streaming_matches_the_sdk_accumulator(gateway_url):
    client = anthropic_client(gateway_url, "a2")
    with client.messages.stream(
        model="loom-tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        message = stream.get_final_message()
    assert message.usage.output_tokens > 0 and message.stop_reason in ("end_turn", "max_tokens")


def test_chat_completions_stream_with_usage(gateway_url):
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="loom-tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    plain = client.chat.completions.create(
        model="loom-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_responses_api_as_codex_uses_it(gateway_url):
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="x", max_retries=0)
    with client.responses.stream(model="loom-tiny", input="hello", max_output_tokens=8) as stream:
        response = stream.get_final_response()
    assert response.usage is not None and response.usage.output_tokens > 0


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/messages", b"{not json", 400, "not valid JSON"),
        (
            "/v1/messages",
            json.dumps({"model": "loom-tiny", "messages": "x", "max_tokens": 5}).encode(),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(),
            404,
            "unknown model",
        ),
        (
            "/v1/responses",
            json.dumps({"model": "loom-tiny", "input": "x" * 300_000}).encode(),
            413,
            "exceeds",
        ),
    ],
)
def test_bad_requests_get_clear_errors_in_the_apis_shape(gateway_url, path, body, status, needle):
    response = httpx.post(f"{gateway_url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"]


def test_models_root_and_metrics(gateway_url):
    assert httpx.head(f"{gateway_url}/").status_code == 200
    assert httpx.get(f"{gateway_url}/v1/models").json()["data"][0]["id"] == "loom-tiny"
    metrics = httpx.get(f"{gateway_url}/metrics").text
    assert "loom_gateway_requests_total" in metrics and "loom_backend_up" in metrics


def test_an_edited_reply_falls_back_to_full_tokenization(gateway_url):
    client = anthropic_client(gateway_url, "a3")
    history = [{"role": "user", "content": "Tell me about rivers."}]
    first = client.messages.create(model="loom-tiny", max_tokens=8, messages=history)
    history += [{"role": "assistant", "content": "an edited reply"}, {"role": "user", "content": "more"}]
    second = client.messages.create(model="loom-tiny", max_tokens=4, messages=history)
    stats = httpx.get(f"{gateway_url}/v1/loom/sessions/a3").json()
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    second_prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    # Only the prompt up to the assistant's turn is shared; the generated ids are not spliced in.
    assert round(stats["append_ratio"] * second_prompt) <= first_prompt
