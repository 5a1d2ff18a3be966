"""HTTP client for one backend (Loom's engine or an SGLang server): SGLang's native `/generate`.

`stream()` posts token ids with `stream: true` and turns SGLang's cumulative SSE chunks (`data: {text,
output_ids, meta_info}`, then `data: [DONE]`) into increments. Failures map to one small hierarchy,
translated once here (httpx errors never leak):

    BackendError                  status the gateway answers with
    ├── BackendUnavailable        502: connection refused/reset, 5xx, a stream cut short
    ├── BackendTimeout            504: no answer within the timeout
    └── BackendRejected           the backend's own 4xx (bad input the gateway let through)
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import httpx


class BackendError(Exception):
    status = 502

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BackendUnavailable(BackendError):
    status = 502


class BackendTimeout(BackendError):
    status = 504


class BackendRejected(BackendError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Increment:
    """What one streamed chunk added."""

    text: str
    token_ids: list[int]
    meta_info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False


class BackendClient:
    def __init__(self, base_url: str, http: httpx.AsyncClient, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)

    async def health(self) -> bool:
        try:
            response = await self._http.get(f"{self.base_url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def abort(self, rid: str) -> None:
        """Best effort: the backend may already have finished the request."""
        try:
            await self._http.post(f"{self.base_url}/abort_request", json={"rid": rid}, timeout=5.0)
        except httpx.HTTPError:
            return

    async def stream(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str
    ) -> AsyncGenerator[Increment, None]:
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid, "stream": True}
        shown_text, shown_ids = "", 0
        try:
            async with self._http.stream(
                "POST", f"{self.base_url}/generate", json=body, timeout=self._timeout
            ) as response:
                if response.status_code != 200:
                    raise _rejection(response.status_code, (await response.aread()).decode(errors="replace"))
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    chunk = json.loads(payload)
                    text, ids = chunk.get("text", ""), chunk.get("output_ids", [])
                    meta = chunk.get("meta_info", {})
                    finished = meta.get("finish_reason") is not None
                    yield Increment(text[len(shown_text) :], ids[shown_ids:], meta, finished)
                    shown_text, shown_ids = text, len(ids)
        except httpx.TimeoutException as exc:
            raise BackendTimeout(f"backend {self.base_url} timed out: {exc}") from exc
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"backend {self.base_url} failed: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise BackendUnavailable(f"backend {self.base_url} sent a malformed chunk: {exc}") from exc
        raise BackendUnavailable(f"backend {self.base_url} ended the stream without [DONE]")


def _rejection(status: int, body: str) -> BackendError:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:500]
    if 400 <= status < 500:
        return BackendRejected(status, message)
    return BackendUnavailable(f"backend answered {status}: {message}")
