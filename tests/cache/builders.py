"""Builders shared by the cache-core tests: a cache, a request's whole life, and tree layouts."""

from __future__ import annotations

from collections.abc import Sequence

from backend.cache import Admission, CacheConfig, RestorePlan, Tier, TieredCache

PAGE = 4


def make_cache(policy: str, device_pages: int, host_pages: int = 0, swap_pages: int = 0) -> TieredCache:
    return TieredCache(
        CacheConfig(
            device_tokens=device_pages * PAGE,
            page_size=PAGE,
            host_tokens=host_pages * PAGE,
            swap_buffer_tokens=swap_pages * PAGE,
            eviction_policy=policy,
        )
    )


def tokens(base: int, num_pages: int) -> list[int]:
    """`num_pages` whole pages of distinct token ids starting at `base`."""
    return list(range(base, base + num_pages * PAGE))


def serve(cache: TieredCache, prompt: Sequence[int]) -> tuple[RestorePlan, Admission]:
    """Run one request to completion (no output tokens), checking integrity after every step."""
    cache.tick()
    plan = cache.plan(cache.match(prompt[:-1]), len(prompt))
    cache.lock(plan.last_node)
    admission = cache.admit(plan)
    cache.check_integrity()
    whole = len(prompt) // PAGE
    cache.insert(prompt[: whole * PAGE], admission.page_table[:whole])
    cache.free(admission.page_table[whole:])
    cache.unlock(plan.last_node)
    cache.check_integrity()
    return plan, admission


def layout(cache: TieredCache, prompt: Sequence[int]) -> list[tuple[int, str]]:
    """(tokens, where) of each segment matching `prompt`: where is device, host or hole."""
    segments = cache.match(prompt).segments
    return [(s.span.num_tokens, s.tier.value if s.tier else "hole") for s in segments]


def device_handles(cache: TieredCache, prompt: Sequence[int]) -> list[int]:
    return [h for s in cache.match(prompt).segments if s.tier is Tier.DEVICE for h in s.handles]
