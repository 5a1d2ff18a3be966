"""Restore plans: phantoms for holes worth filling, loads for host segments, trailing holes dropped."""

from __future__ import annotations

import pytest

from backend.cache import CacheConfig, Span, Tier, TieredCache
from tests.cache.builders import PAGE, layout, make_cache, serve, tokens

S = tokens(0, 2)
A = S + tokens(1000, 8)
B = S + tokens(2000, 5)


def front_evicted(min_kept_tokens: int = 1) -> TieredCache:
    """A = [S device][3 pages hole][5 pages device], as in the split example."""
    cache = TieredCache(
        CacheConfig(
            device_tokens=15 * PAGE,
            page_size=PAGE,
            eviction_policy="penelope",
            min_kept_tokens=min_kept_tokens,
        )
    )
    serve(cache, A)
    serve(cache, B)
    cache.evict(3 * PAGE, Tier.DEVICE)
    return cache


def test_match_walks_through_a_hole_to_the_history_kept_after_it():
    cache = front_evicted()
    match = cache.match(A + [1, 2, 3])
    assert match.num_tokens == 40
    assert match.device_prefix_tokens == 8
    assert [(s.tier, s.span) for s in match.segments] == [
        (Tier.DEVICE, Span(0, 8)),
        (None, Span(8, 20)),
        (Tier.DEVICE, Span(20, 40)),
    ]


def test_hole_before_kept_history_is_recomputed_in_place():
    cache = front_evicted()
    prompt = A + tokens(5000, 1)
    plan, admission = serve(cache, prompt)
    assert plan.phantom_spans == (Span(8, 20),)
    assert [s.span for s in plan.reused] == [Span(0, 8), Span(20, 40)]
    assert plan.compute == Span(40, 44)
    assert (plan.cached_tokens, plan.recomputed_tokens, plan.loaded_tokens) == (28, 12, 0)
    assert len(admission.page_table) == 11
    assert layout(cache, prompt) == [(44, "device")]  # the hole was filled by the insert


def test_hole_at_the_end_of_the_match_is_part_of_the_requests_own_prefill():
    cache = front_evicted()
    prompt = A[:20] + tokens(7000, 2)  # shares S and the evicted pages, then diverges
    plan = cache.plan(cache.match(prompt[:-1]), len(prompt))
    assert plan.phantoms == ()
    assert plan.compute == Span(8, 28)


def test_too_little_kept_after_a_hole_is_not_worth_a_phantom():
    cache = front_evicted(min_kept_tokens=24)  # only 20 tokens are kept after the hole
    prompt = A + [1]
    plan = cache.plan(cache.match(prompt[:-1]), len(prompt))
    assert plan.phantoms == ()
    assert plan.compute == Span(8, 41)


def test_plan_requires_one_token_left_to_compute():
    cache = make_cache("penelope", device_pages=4)
    serve(cache, tokens(0, 2) + [9])
    with pytest.raises(ValueError, match="match tokens\\[:-1\\]"):
        cache.plan(cache.match(tokens(0, 2)), 8)


def test_host_segment_is_loaded_and_becomes_device_kv():
    cache = make_cache("penelope", device_pages=12, host_pages=8, swap_pages=2)
    serve(cache, tokens(0, 8))
    serve(cache, tokens(100, 4))
    serve(cache, tokens(200, 4))  # moves the front 4 pages of the first history to host
    assert layout(cache, tokens(0, 8)) == [(16, "host"), (16, "device")]
    prompt = tokens(0, 8) + [1]
    plan, admission = serve(cache, prompt)
    assert [s.span for s in plan.loads] == [Span(0, 16)]
    transfers = admission.eviction.transfers
    loads = sorted((t.src, t.dst) for t in transfers if t.src_tier is Tier.HOST)
    assert loads == list(zip([0, 1, 2, 3], admission.page_table[:4], strict=True))
    # Both tiers were full: the last offload went through a swap-buffer page (host pages 8-9).
    assert [t.dst for t in transfers if t.src_tier is Tier.DEVICE] == [4, 5, 6, 7, 9]
    assert layout(cache, prompt[:-1]) == [(32, "device")]
