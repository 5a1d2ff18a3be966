"""Narrative tests of the eviction policies: exact victims, in order, for small hand-built trees."""

from __future__ import annotations

import pytest

from backend.cache import POLICIES, CacheConfig, Tier, TieredCache
from tests.cache.builders import PAGE, layout, make_cache, serve, tokens

S = tokens(0, 2)  # a shared prefix of 2 pages
A = S + tokens(1000, 8)
B = S + tokens(2000, 5)
C = S + tokens(3000, 3)


def three_sessions(policy: str):
    """S shared by A (oldest), B and C; the device is exactly full (18 pages)."""
    cache = make_cache(policy, device_pages=18)
    for prompt in (A, B, C):
        serve(cache, prompt)
    assert cache.size_info().device_free_pages == 0
    return cache


def test_registry_lists_all_policies_and_rejects_unknown_names():
    assert POLICIES.names() == ["lru", "lru-block", "leaf-head", "penelope"]
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'; known: lru, lru-block"):
        POLICIES.create("fifo")


def test_penelope_splits_the_start_node_and_frees_only_the_leading_blocks():
    """The paper's Figure 3: 3 blocks needed, the start node holds 8 -> free the first 3, keep 5."""
    cache = make_cache("penelope", device_pages=15)
    serve(cache, A)  # handles 0-1 (S) and 2-9 (A's own 8 pages)
    serve(cache, B)  # splits S off; B's own pages are 10-14
    eviction = cache.evict(3 * PAGE, Tier.DEVICE)
    cache.check_integrity()
    assert eviction.deleted[Tier.DEVICE] == [2, 3, 4]
    assert layout(cache, A) == [(8, "device"), (12, "hole"), (20, "device")]
    assert layout(cache, B) == [(28, "device")]


@pytest.mark.parametrize(
    ("policy", "victims", "a_layout"),
    [
        # SGLang: the whole least recently used leaf, then the next: 13 pages for a need of 10.
        ("lru", [*range(2, 10), *range(10, 15)], [(8, "device")]),
        # Only what is needed, from the tail of A's leaf and then of B's.
        ("lru-block", [*range(2, 10), 13, 14], [(8, "device")]),
        # Only what is needed, from the head of each leaf node.
        ("leaf-head", [*range(2, 10), 10, 11], [(8, "device")]),
        # The private history of A, then the front of B's; S stays while B and C share it.
        ("penelope", [*range(2, 10), 10, 11], [(8, "device")]),
    ],
)
def test_victim_order_over_three_sessions(policy, victims, a_layout):
    cache = three_sessions(policy)
    eviction = cache.evict(10 * PAGE, Tier.DEVICE)
    cache.check_integrity()
    assert eviction.deleted[Tier.DEVICE] == victims
    assert layout(cache, A) == a_layout
    assert layout(cache, C) == [(20, "device")]


def test_penelope_keeps_the_shared_prefix_while_private_history_remains():
    cache = three_sessions("penelope")
    cache.evict(13 * PAGE, Tier.DEVICE)  # all of A's and B's private pages
    cache.check_integrity()
    assert layout(cache, B) == [(8, "device")]  # B's private chain had no KV left and was collected
    assert layout(cache, C) == [(20, "device")]
    # Now only C uses S: S is the start of C's private history and goes first.
    assert cache.evict(2 * PAGE, Tier.DEVICE).deleted[Tier.DEVICE] == [0, 1]
    assert layout(cache, C) == [(8, "hole"), (12, "device")]


X1 = tokens(0, 2)
X2 = X1 + tokens(100, 4)


def chain(policy: str):
    """root -> X1 (2 pages, handles 0-1) -> X2's own 4 pages (handles 2-5); full."""
    cache = make_cache(policy, device_pages=6)
    serve(cache, X1 + [7])
    serve(cache, X2)
    return cache


@pytest.mark.parametrize(
    ("policy", "victims", "remaining"),
    [
        ("lru", [2, 3, 4, 5], [(8, "device")]),
        ("lru-block", [5], [(20, "device")]),
        ("leaf-head", [2], [(8, "device"), (4, "hole"), (12, "device")]),
        # Walks up to X1 (its parent is the root), frees both its pages, then continues toward the leaf.
        ("penelope", [0, 1, 2], [(12, "hole"), (12, "device")]),
    ],
)
def test_one_history_of_two_nodes(policy, victims, remaining):
    cache = chain(policy)
    need = 3 if policy == "penelope" else 1
    eviction = cache.evict(need * PAGE, Tier.DEVICE)
    cache.check_integrity()
    assert eviction.deleted[Tier.DEVICE] == victims
    assert layout(cache, X2) == remaining


def test_penelope_stops_below_a_parent_locked_by_a_running_request():
    cache = chain("penelope")
    running = cache.match(X1).last_node
    cache.lock(running)
    eviction = cache.evict(PAGE, Tier.DEVICE)
    assert eviction.deleted[Tier.DEVICE] == [2]
    assert layout(cache, X2) == [(8, "device"), (4, "hole"), (12, "device")]
    cache.unlock(running)
    cache.check_integrity()


def test_penelope_stops_below_a_hole_and_extends_it():
    cache = chain("penelope")
    first = cache.evict(2 * PAGE, Tier.DEVICE)
    second = cache.evict(PAGE, Tier.DEVICE)
    cache.check_integrity()
    assert (first.deleted[Tier.DEVICE], second.deleted[Tier.DEVICE]) == ([0, 1], [2])
    assert layout(cache, X2) == [(12, "hole"), (12, "device")]


def test_locked_history_is_never_evicted():
    cache = chain("penelope")
    running = cache.match(X2).last_node
    cache.lock(running)
    eviction = cache.evict(PAGE, Tier.DEVICE)
    assert eviction.deleted[Tier.DEVICE] == []
    cache.unlock(running)
    assert cache.evict(PAGE, Tier.DEVICE).deleted[Tier.DEVICE] == [0]


def test_least_recently_used_history_goes_first_after_a_hit():
    cache = three_sessions("penelope")
    _, admission = serve(cache, A + [5])  # A becomes the most recently used history
    assert admission.eviction.deleted[Tier.DEVICE] == [10]  # its one new page came from B's front
    eviction = cache.evict(2 * PAGE, Tier.DEVICE)
    assert eviction.deleted[Tier.DEVICE] == [11, 12]  # B is still the LRU history


# Regressions found by the stateful tests.


def _serve_page1(cache: TieredCache, prompt: list[int]) -> None:
    cache.tick()
    plan = cache.plan(cache.match(prompt[:-1]), len(prompt))
    cache.lock(plan.last_node)
    admission = cache.admit(plan)
    cache.insert(prompt, admission.page_table[: len(prompt)])
    cache.unlock(plan.last_node)


def test_tier_leaf_policies_reach_a_tier_ancestor_above_a_hole():
    """lru/lru-block/leaf-head: once the leaf is evicted, its nearest tier ancestor above a hole is next."""
    cache = TieredCache(
        CacheConfig(device_tokens=8, host_tokens=2, swap_buffer_tokens=0, eviction_policy="leaf-head")
    )
    _serve_page1(cache, [10, 100, 0])  # device pages 0-2, one node
    cache.evict(1, Tier.DEVICE)  # head [10] -> host
    cache.evict(2, Tier.DEVICE)  # one host page left: [100] is deleted (a hole), [0] -> host
    assert cache.size_info().host_cached_pages == 2
    eviction = cache.evict(2, Tier.HOST)
    assert len(eviction.deleted[Tier.HOST]) == 2  # was 1: [10] never became a candidate
    cache.check_integrity()


def test_penelope_evicts_a_shared_prefix_whose_histories_moved_to_host():
    """A device prefix shared by histories now on host is still evictable, as can_admit assumes."""
    cache = TieredCache(
        CacheConfig(device_tokens=4, host_tokens=4, swap_buffer_tokens=0, eviction_policy="penelope")
    )
    _serve_page1(cache, [7, 1])
    _serve_page1(cache, [7, 2])
    cache.evict(2, Tier.DEVICE)  # both private pages -> host; shared [7] stays on device
    assert cache.evict(1, Tier.DEVICE).offloaded == [0]  # was []: no victim found
    cache.check_integrity()
