"""The simulated server: timing from the cost model, cache decisions from the real core."""

from __future__ import annotations

import pytest

from backend.cache import CacheConfig, TieredCache
from backend.cache.cost import Hardware, model_shape, prefill_seconds, span_cost
from backend.cache.types import Span
from bench.serving_model import ServingConfig, Simulator
from bench.traces import Session, TokenSynthesizer, TraceRequest

PAGE = 64
SHAPE = model_shape("qwen3-8b")
# Round numbers so expected times are easy to state: 1e15 FLOP/s, 10 ms per decode step.
HARDWARE = Hardware(
    "test", effective_flops_per_s=1e15, decode_s_per_step=0.01, host_bandwidth_bytes_per_s=1e10
)


def session(name: str, blocks_per_request: list[int], out: int = 4, think: float = 1.0) -> Session:
    """Requests that each extend the previous one by whole 64-token blocks."""
    requests = tuple(
        TraceRequest(0.0, "n", "m", PAGE * n, out, tuple(range(1, n + 1)), think if i else 0.0, "tool_use")
        for i, n in enumerate(blocks_per_request)
    )
    return Session(name, tool_tokens=0, system_tokens=0, requests=requests)


def run(sessions, policy="penelope", device_pages=1000, slots=1, **serving):
    cache = TieredCache(
        CacheConfig(device_tokens=device_pages * PAGE, page_size=PAGE, eviction_policy=policy)
    )
    config = ServingConfig(num_slots=slots, **serving)
    result = Simulator(cache, SHAPE, HARDWARE, config, TokenSynthesizer(seed=1).prompt_tokens).run(sessions)
    cache.check_integrity()
    return result


def test_ttft_is_the_prefill_of_what_is_not_cached_and_think_time_separates_turns():
    result = run([session("a", [10, 12])], max_batch_tokens=100_000)
    first, second = result.requests
    assert first.ttft_s == pytest.approx(prefill_seconds(SHAPE, HARDWARE, [Span(0, 640)]))
    # The second prompt reuses 640 tokens (whole pages of the first minus the page kept for logits).
    assert (second.cached_tokens, second.recomputed_tokens) == (640, 0)
    assert second.ttft_s == pytest.approx(prefill_seconds(SHAPE, HARDWARE, [Span(640, 768)]))
    # 4 output tokens: the first with the prefill, three decode steps after it; then 1 s of think time.
    assert first.finish_s == pytest.approx(first.first_token_s + 3 * 0.01)
    assert second.arrival_s == pytest.approx(first.finish_s + 1.0)
    assert result.session_times_s == {"a": pytest.approx(second.finish_s)}


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    whole = run([session("a", [10])], max_batch_tokens=100_000).requests[0].ttft_s
    chunked = run([session("a", [10])], max_batch_tokens=64).requests[0].ttft_s
    assert chunked == pytest.approx(whole)  # the same work, in ten steps, with nothing else running


def test_eviction_pressure_recomputes_less_costly_tokens_with_penelope():
    """Two sessions that do not fit together: penelope loses fronts, lru loses tails."""
    sessions = [session("a", [30, 31, 32, 33], think=5.0), session("b", [30, 31, 32, 33], think=5.0)]
    results = {policy: run(sessions, policy, device_pages=50, slots=2) for policy in ("lru", "penelope")}
    cost = {p: sum(r.recompute_cost_units for r in res.requests) for p, res in results.items()}
    assert cost["penelope"] < cost["lru"]
    assert sum(r.phantom_tokens for r in results["penelope"].requests) > 0
    assert sum(r.phantom_tokens for r in results["lru"].requests) == 0


def test_recompute_cost_counts_the_lost_positions():
    sessions = [session("a", [30, 31], think=5.0), session("b", [30, 31], think=5.0)]
    lost = [r for r in run(sessions, "lru", device_pages=40, slots=2).requests if r.recomputed_tokens]
    assert lost
    for request in lost:
        start = request.prompt_tokens - request.computed_tokens
        assert request.recompute_cost_units == span_cost(SHAPE, start, start + request.recomputed_tokens)


def test_requests_larger_than_the_device_are_skipped():
    result = run([session("a", [10, 40, 12])], device_pages=20)
    assert result.skipped_requests == 1
    assert [r.index for r in result.requests] == [0, 2]


def test_max_requests_stops_issuing():
    result = run([session("a", [1, 2, 3]), session("b", [1, 2])], max_requests=3)
    assert len(result.requests) == 3


def test_sessions_beyond_the_slots_wait_for_a_free_slot():
    result = run([session("a", [2, 3]), session("b", [2])], slots=1)
    a_end = max(r.finish_s for r in result.requests if r.session_id == "a")
    b_start = min(r.arrival_s for r in result.requests if r.session_id == "b")
    assert b_start == pytest.approx(a_end)


def test_config_is_validated():
    with pytest.raises(ValueError, match="scheduler must be one of lpm, fcfs"):
        ServingConfig(scheduler="random")
    with pytest.raises(ValueError, match="num_slots must be at least 1"):
        ServingConfig(num_slots=0)
