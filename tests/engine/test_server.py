"""The SGLang-native HTTP server over the engine: shapes, streaming, cache reuse, aborts, errors, CLI.

One uvicorn server on a free loopback port (in a thread) serves the module, over real HTTP. Its
model is the tiny one with SmolLM2's vocabulary and real tokenizer (built once into a temporary
LOOM_CACHE_DIR, ~5 s), its weights scaled to std 0.2 so that greedy outputs vary from token to token.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from backend.engine.config import tiny_config
from backend.engine.engine import Engine, EngineConfig
from backend.engine.launch import build_parser, build_runner, load_model, main
from backend.engine.runner import EngineRunner, ServerArgs, TextCodec
from backend.engine.server import create_app
from tests.serving import running

VOCAB = tiny_config().vocab_size
CONFIG = EngineConfig(kv_cache_tokens=16384, page_size=4, max_batch_tokens=256)
LONG = 12000  # max_new_tokens of requests that must still be running when the test stops them


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loom-cache")


@pytest.fixture(scope="module")
def loaded(cache_dir: Path) -> tuple[torch.nn.Module, TextCodec, str, str]:
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOOM_CACHE_DIR", str(cache_dir))
        model, codec, model_path, tokenizer_path = load_model("tiny")
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.mul_(10)
    return model, codec, model_path, tokenizer_path


@pytest.fixture(scope="module")
def runner(loaded: tuple[Any, TextCodec, str, str]) -> EngineRunner:
    model, codec, model_path, tokenizer_path = loaded
    engine = Engine(model, CONFIG, decode=codec.decode)
    return EngineRunner(engine, codec, ServerArgs(model_path, tokenizer_path, threads=1))


@pytest.fixture(scope="module")
def base_url(runner: EngineRunner) -> Iterator[str]:
    with running(create_app(runner)) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        yield http


##### Helpers #####


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_new_tokens: int, **extra: object) -> dict[str, object]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **extra}


def generate(client: httpx.Client, **body: object) -> dict[str, Any]:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """SSE ``data:`` payloads: JSON objects, then the literal ``[DONE]``."""
    for line in lines:
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == "[DONE]" else json.loads(payload)


def stream(client: httpx.Client, **body: object) -> list[Any]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(events(response.iter_lines()))


def engine_state(runner: EngineRunner) -> tuple[int, int, int]:
    """(running, waiting, device pages held by requests), read on the loop thread."""
    return runner.call(
        lambda e: (len(e.running), len(e.waiting), e.cache.size_info().device_in_use_pages)
    ).result(timeout=10)


def wait_idle(runner: EngineRunner) -> None:
    deadline = time.monotonic() + 10
    while (state := engine_state(runner)) != (0, 0, 0):
        assert time.monotonic() < deadline, f"engine still busy: (running, waiting, pages) = {state}"
        time.sleep(0.01)


def metrics(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


##### /generate #####


def test_generate_by_input_ids_returns_sglang_fields(client, runner):
    ids = prompt(1, 20)
    out = generate(client, input_ids=ids, sampling_params=greedy(6), rid="ids-1")
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert meta["id"] == "ids-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"], len(out["output_ids"])) == (20, 6, 6)
    assert out["text"] == runner.codec.decode(out["output_ids"])
    assert meta["cached_tokens"] == meta["cached_tokens_details"]["device"] == 0
    assert (meta["recomputed_hole_tokens"], meta["host_loaded_tokens"]) == (0, 0)
    assert 0 < meta["first_token_latency"] <= meta["e2e_latency"]
    assert "input_token_logprobs" not in meta


def test_text_prompt_is_tokenized_as_its_input_ids(client, runner):
    text = "def square(x):\n    return x * x  # café 🙂\n"
    by_text = generate(client, text=text, sampling_params=greedy(5))
    by_ids = generate(client, input_ids=runner.codec.encode(text), sampling_params=greedy(5))
    assert by_text["meta_info"]["prompt_tokens"] == len(runner.codec.encode(text))
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["text"] == by_ids["text"]


@pytest.mark.parametrize("by", ["input_ids", "text"])
def test_stream_sends_cumulative_chunks_then_done(client, runner, by):
    ids = prompt(2, 12)
    source = {"input_ids": ids} if by == "input_ids" else {"text": runner.codec.decode(ids)}
    chunks = stream(client, **source, sampling_params=greedy(8))
    assert chunks[-1] == "[DONE]"
    data = chunks[:-1]
    assert all(chunk["meta_info"]["completion_tokens"] == len(chunk["output_ids"]) for chunk in data)
    for before, after in itertools.pairwise(data):  # a slow reader gets fewer, bigger steps
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
        assert before["meta_info"]["finish_reason"] is None
    final = data[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    reference = generate(client, **source, sampling_params=greedy(8))
    assert (final["output_ids"], final["text"]) == (reference["output_ids"], reference["text"])
    assert "e2e_latency" in final["meta_info"] and "e2e_latency" not in data[0]["meta_info"]


def test_a_request_extending_the_previous_one_reports_cached_tokens(client):
    first_prompt = prompt(3, 24)
    first = generate(client, input_ids=first_prompt, sampling_params=greedy(4))
    second = generate(
        client, input_ids=first_prompt + first["output_ids"] + prompt(4, 8), sampling_params=greedy(2)
    )
    meta = second["meta_info"]
    # Page size 4: the first prompt and its computed output are cached in whole pages.
    assert meta["cached_tokens"] >= len(first_prompt)
    assert meta["cached_tokens_details"] == {"device": meta["cached_tokens"], "host": 0}


def test_logprobs_are_sglang_triples(client, runner):
    ids = prompt(5, 10)
    out = generate(client, input_ids=ids, sampling_params=greedy(5), return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    prompt_lps, output_lps = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert prompt_lps[0] == [None, ids[0], None], "the first prompt token has no logprob"
    assert [t for _, t, _ in prompt_lps] == ids
    assert [t for _, t, _ in output_lps] == out["output_ids"]
    assert meta["output_token_logprobs_length"] == len(out["output_ids"]) == 5
    assert all(lp <= 0 and text is None for lp, _, text in prompt_lps[1:] + output_lps)

    tail = generate(
        client, input_ids=ids, sampling_params=greedy(5), return_logprob=True, logprob_start_len=7,
        return_text_in_logprobs=True,
    )["meta_info"]  # fmt: skip
    assert [t for _, t, _ in tail["input_token_logprobs"]] == ids[7:]
    assert [text for _, _, text in tail["input_token_logprobs"]] == [
        runner.codec.decode([t]) for t in ids[7:]
    ]
    for (lp, _, _), (whole, _, _) in zip(tail["input_token_logprobs"], prompt_lps[7:], strict=True):
        assert lp == pytest.approx(whole, abs=1e-4)
    default = generate(client, input_ids=ids, sampling_params=greedy(2), return_logprob=True)["meta_info"]
    assert default["input_token_logprobs"] == [] and len(default["output_token_logprobs"]) == 2


def test_stop_string_ends_generation_and_is_trimmed(client):
    ids = prompt(6, 16)
    full = generate(client, input_ids=ids, sampling_params=greedy(24))["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.find(stop)]
    out = generate(client, input_ids=ids, sampling_params=greedy(24, stop=stop))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == expected
    kept = generate(client, input_ids=ids, sampling_params=greedy(24, stop=[stop], no_stop_trim=True))
    assert kept["text"] == expected + stop, "no_stop_trim keeps the stop string, not what follows it"
    chunks = stream(client, input_ids=ids, sampling_params=greedy(24, stop=stop))[:-1]
    assert chunks[-1]["text"] == expected
    assert all(expected.startswith(chunk["text"]) for chunk in chunks), "no chunk shows the stop string"


def test_stop_token_ends_generation_and_adds_no_text(client, runner):
    ids = prompt(7, 16)
    reference = generate(client, input_ids=ids, sampling_params=greedy(12))["output_ids"]
    stop_id = reference[5]
    out = generate(client, input_ids=ids, sampling_params=greedy(12, stop_token_ids=[stop_id]))
    end = reference.index(stop_id) + 1
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == reference[:end]
    assert out["text"] == runner.codec.decode(reference[: end - 1])


def test_concurrent_requests_all_complete(client):
    def one(i: int) -> dict[str, Any]:
        body = {"input_ids": prompt(100 + i, 8 + 3 * i), "sampling_params": greedy(8)}
        return stream(client, **body)[-2] if i % 2 else generate(client, **body)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, range(8)))
    assert [r["meta_info"]["finish_reason"] for r in results] == [{"type": "length", "length": 8}] * 8
    assert len({r["meta_info"]["id"] for r in results}) == 8


##### Aborts and flush #####


def test_abort_request_ends_a_running_stream(client, runner):
    body = {"input_ids": prompt(8, 16), "sampling_params": greedy(LONG), "stream": True, "rid": "abort-me"}
    with client.stream("POST", "/generate", json=body) as response:
        chunks = events(response.iter_lines())
        assert next(chunks)["meta_info"]["finish_reason"] is None
        taken = client.post("/generate", json={**body, "stream": False})
        assert taken.status_code == 400 and "already in use" in taken.json()["error"]["message"]
        aborted = client.post("/abort_request", json={"rid": "abort-me"})
        assert (aborted.status_code, aborted.json()) == (200, {"aborted": 1})
        rest = list(chunks)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(rest[-2]["output_ids"]) < LONG
    wait_idle(runner)
    assert client.post("/abort_request", json={"rid": "abort-me"}).json() == {"aborted": 0}


def test_client_disconnect_aborts_the_request(client, runner):
    aborted_before = metrics(client)["sglang:num_aborted_requests_total"]
    body = {"input_ids": prompt(9, 16), "sampling_params": greedy(LONG), "stream": True}
    with client.stream("POST", "/generate", json=body) as response:
        assert next(events(response.iter_lines()))["meta_info"]["finish_reason"] is None
    wait_idle(runner)  # the abort counter below, not this wait, shows that it was aborted
    assert metrics(client)["sglang:num_aborted_requests_total"] == aborted_before + 1


def test_client_disconnect_aborts_a_non_streaming_request(client, runner, base_url):
    aborted_before = metrics(client)["sglang:num_aborted_requests_total"]
    body = json.dumps({"input_ids": prompt(13, 16), "sampling_params": greedy(LONG)}).encode()
    head = f"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    host, port = httpx.URL(base_url).host, httpx.URL(base_url).port
    with socket.create_connection((host, port)) as raw:
        raw.sendall(head + body)
        deadline = time.monotonic() + 10
        while engine_state(runner)[0] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    wait_idle(runner)  # the handler checks for a gone client every second
    assert metrics(client)["sglang:num_aborted_requests_total"] == aborted_before + 1


def test_flush_cache_drops_cached_prefixes_and_is_refused_while_running(client, runner):
    ids = prompt(10, 24)
    generate(client, input_ids=ids, sampling_params=greedy(2))
    assert generate(client, input_ids=ids, sampling_params=greedy(2))["meta_info"]["cached_tokens"] > 0
    flushed = client.post("/flush_cache")
    assert (flushed.status_code, flushed.text) == (200, "Cache flushed.\n")
    assert generate(client, input_ids=ids, sampling_params=greedy(2))["meta_info"]["cached_tokens"] == 0
    body = {"input_ids": prompt(11, 8), "sampling_params": greedy(LONG), "stream": True, "rid": "busy"}
    with client.stream("POST", "/generate", json=body) as response:
        chunks = events(response.iter_lines())  # NOTE: dropping it would close the connection (an abort)
        assert next(chunks)["meta_info"]["finish_reason"] is None
        refused = client.post("/flush_cache")
        assert (refused.status_code, refused.text) == (
            400,
            "Cache not flushed: requests are running or waiting.\n",
        )
        assert client.post("/abort_request", json={"abort_all": True}).json() == {"aborted": 1}
    wait_idle(runner)


##### Metrics and info #####


def test_metrics_count_tokens_and_requests(client):
    names = [
        "sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:load_back_tokens_total",
        'sglang:cached_tokens_total{cache_source="device"}',
        'sglang:cached_tokens_total{cache_source="host"}',
        "loom_recomputed_hole_tokens_total", "loom_evicted_tokens_total", "loom_offloaded_tokens_total",
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "loom_kv_usage",
        "sglang:time_to_first_token_seconds_count", "sglang:e2e_request_latency_seconds_count",
        "sglang:num_requests_total", "sglang:num_aborted_requests_total",
    ]  # fmt: skip
    before = metrics(client)
    assert set(names) <= set(before)
    ids = prompt(12, 9)
    generate(client, input_ids=ids, sampling_params=greedy(5))
    after = metrics(client)
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == 9
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 5
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == 1
    count = "sglang:time_to_first_token_seconds_count"
    assert after[count] - before[count] == 1
    assert 0 < after["loom_kv_usage"] <= 1, "the finished request's pages stay cached"


def test_health_model_info_and_server_info(client):
    assert client.get("/health").status_code == 200
    model = client.get("/get_model_info").json()
    assert model["model_path"] == "tiny" and model["tokenizer_path"].endswith(".gguf")
    assert model["is_generation"] is True
    assert model["model_config"]["vocab_size"] == VOCAB
    server = client.get("/get_server_info").json()
    for name in ("kv_cache_tokens", "page_size", "eviction_policy", "schedule_policy", "max_batch_tokens"):
        assert server[name] == getattr(CONFIG, name)
    assert server["max_total_num_tokens"] == CONFIG.kv_cache_tokens
    assert server["internal_states"][0]["device_pages"] == CONFIG.kv_cache_tokens // CONFIG.page_size
    assert client.get("/server_info").json().keys() == server.keys()


##### Errors #####


BAD_REQUESTS = [
    pytest.param(b"{bad", "not valid JSON", id="malformed-json"),
    pytest.param([{"text": "a"}], "must be a JSON object", id="not-an-object"),
    pytest.param({"text": "a", "foo": 1}, "unknown field 'foo'", id="unknown-field"),
    pytest.param({"text": "a", "sampling_params": {"max_tokens": 5}},
                 "unknown field 'sampling_params.max_tokens'", id="unknown-sampling-param"),
    pytest.param({"text": "a", "sampling_params": {"max_new_tokens": "5"}},
                 "sampling_params.max_new_tokens", id="string-for-int"),
    pytest.param({"text": "a", "stream": "yes"}, "stream", id="string-for-bool"),
    pytest.param({"text": "a", "input_ids": [1]}, "exactly one of", id="text-and-ids"),
    pytest.param({}, "exactly one of", id="no-prompt"),
    pytest.param({"text": ["a", "b"]}, "batch", id="batch-text"),
    pytest.param({"input_ids": [[1], [2]]}, "batch", id="batch-ids"),
    pytest.param({"input_ids": []}, "empty", id="empty-prompt"),
    pytest.param({"input_ids": [5] * 20000}, "exceeds the KV cache", id="prompt-too-long"),
    pytest.param({"input_ids": [5], "sampling_params": {"max_new_tokens": 20000}},
                 "exceeds the KV cache", id="output-too-long"),
    pytest.param({"input_ids": [5], "stream": True, "sampling_params": {"max_new_tokens": 20000}},
                 "exceeds the KV cache", id="too-long-stream"),
    pytest.param({"input_ids": [1, VOCAB]}, f"token ids must be in [0, {VOCAB})", id="id-too-large"),
    pytest.param({"input_ids": [-1]}, "token ids must be in", id="negative-id"),
    pytest.param({"text": "a", "sampling_params": {"temperature": -1}}, "temperature",
                 id="bad-temperature"),
    pytest.param({"text": "a", "sampling_params": {"stop": ""}}, "stop strings", id="empty-stop"),
    pytest.param({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5},
                 "logprob_start_len", id="logprob-start-beyond-prompt"),
    pytest.param({"text": "a", "rid": ""}, "rid", id="empty-rid"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "message"), BAD_REQUESTS)
def test_bad_requests_are_400_with_a_clear_message(client, body, message):
    response = (
        client.post("/generate", content=body)
        if isinstance(body, bytes)
        else client.post("/generate", json=body)
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert (error["type"], error["code"]) == ("invalid_request_error", 400)


def test_abort_request_needs_a_rid_or_abort_all(client):
    assert client.post("/abort_request", json={}).status_code == 400
    assert "unknown field" in client.post("/abort_request", json={"id": "x"}).json()["error"]["message"]


def test_a_failed_engine_loop_fails_requests_and_health(loaded, monkeypatch):
    model, codec, model_path, tokenizer_path = loaded
    broken = Engine(model, EngineConfig(kv_cache_tokens=64, page_size=4), decode=codec.decode)

    def fail() -> list[Any]:
        raise RuntimeError("boom")

    monkeypatch.setattr(broken, "step", fail)
    runner = EngineRunner(broken, codec, ServerArgs(model_path, tokenizer_path))
    with TestClient(create_app(runner)) as http:
        assert http.get("/health").status_code == 200
        failed = http.post("/generate", json={"input_ids": [5, 6], "sampling_params": greedy(2)})
        assert failed.status_code == 500 and "boom" in failed.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        assert http.post("/generate", json={"input_ids": [5, 6]}).status_code == 503


##### Command line #####


def test_engine_flags_default_to_engine_config():
    args = build_parser().parse_args([])
    for name in ("kv_cache_tokens", "page_size", "host_kv_tokens", "eviction_policy", "schedule_policy",
                 "max_batch_tokens", "max_running_requests", "deterministic", "seed"):  # fmt: skip
        assert getattr(args, name) == getattr(EngineConfig(), name)
    assert args.model == "smollm2" and args.threads >= 1


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--eviction-policy", "nope"], id="unknown-policy"),
        pytest.param(["--schedule-policy", "random"], id="unknown-schedule"),
        pytest.param(["--kv-cache-tokens", "100", "--page-size", "16"], id="not-whole-pages"),
        pytest.param(["--max-batch-tokens", "0"], id="zero-batch"),
        pytest.param(["--threads", "0"], id="zero-threads"),
        pytest.param(["--port", "http"], id="port-not-int"),
        pytest.param(["--bogus"], id="unknown-flag"),
    ],
)
def test_bad_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_build_runner_loads_the_tiny_model(cache_dir, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(cache_dir))
    runner = build_runner(
        build_parser().parse_args(["--model", "tiny", "--kv-cache-tokens", "1024", "--threads", "1"])
    )
    assert runner.engine.model.config == tiny_config()
    assert runner.engine.config.kv_cache_tokens == 1024
    assert (runner.args.model_path, runner.args.threads) == ("tiny", 1)
    assert runner.codec.decode(runner.codec.encode("hello world")) == "hello world"
