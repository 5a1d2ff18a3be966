"""The backend client against a live engine server (tiny model, real HTTP) and failing backends."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from gateway.backend_client import BackendClient, BackendRejected, BackendUnavailable, Increment
from tests.engine.test_server import base_url, cache_dir, loaded, runner  # noqa: F401 (fixtures)


def collect(url: str, input_ids: list[int], **params: Any) -> list[Increment]:
    async def run() -> list[Increment]:
        async with httpx.AsyncClient() as http:
            client = BackendClient(url, http)
            sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, **params}
            return [inc async for inc in client.stream(input_ids, sampling, rid="t1")]

    return asyncio.run(run())


def test_stream_yields_increments_that_add_up_to_the_whole_output(base_url, runner):  # noqa: F811
    increments = collect(base_url, [5, 6, 7, 8])
    assert increments[-1].finished and not any(inc.finished for inc in increments[:-1])
    ids = [t for inc in increments for t in inc.token_ids]
    assert len(ids) == 6
    assert increments[-1].meta_info["completion_tokens"] == 6
    assert "".join(inc.text for inc in increments) == runner.codec.decode(ids)


def test_backend_4xx_is_passed_through_with_its_message(base_url):  # noqa: F811
    with pytest.raises(BackendRejected) as info:
        collect(base_url, [5, 10**9])
    assert info.value.status == 400 and "token ids" in info.value.message


def test_unreachable_backend_is_unavailable():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(BackendUnavailable, match="failed"):
        collect(f"http://127.0.0.1:{port}", [5, 6])

    async def health() -> bool:
        async with httpx.AsyncClient() as http:
            return await BackendClient(f"http://127.0.0.1:{port}", http).health()

    assert asyncio.run(health()) is False


def test_stream_cut_short_is_unavailable():
    def cut(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text='data: {"text": "a", "output_ids": [1], "meta_info": {}}\n\n')

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(cut)) as http:
            async for _ in BackendClient("http://backend", http).stream([1], {}, "r"):
                pass

    with pytest.raises(BackendUnavailable, match="without \\[DONE\\]"):
        asyncio.run(run())
