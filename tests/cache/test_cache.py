"""TieredCache: handle ownership on insert and free, locks, garbage collection and the two tiers."""

from __future__ import annotations

import pytest

from backend.cache import CacheConfig, CacheFullError, Tier, TieredCache
from tests.cache.builders import PAGE, layout, make_cache, serve, tokens
from tests.cache.test_policies import _serve_page1 as serve_page1


def test_config_is_validated_on_creation():
    with pytest.raises(ValueError, match="device_tokens must be a non-negative multiple of page_size 4"):
        CacheConfig(device_tokens=10, page_size=4)
    with pytest.raises(ValueError, match="at least one page"):
        CacheConfig(device_tokens=0)
    assert (
        CacheConfig(device_tokens=8, host_tokens=0, swap_buffer_tokens=4, page_size=4).swap_buffer_pages == 0
    )


def test_insert_frees_pages_someone_else_cached_meanwhile():
    cache = make_cache("lru", device_pages=8)
    prompt = tokens(0, 2) + [5]
    first, second = [cache.plan(cache.match(prompt[:-1]), len(prompt)) for _ in range(2)]
    cache.lock(first.last_node)
    a, b = cache.admit(first), cache.admit(second)  # both computed the same two pages
    assert cache.insert(prompt[:8], a.page_table[:2]) == (2, 0)
    assert cache.insert(prompt[:8], b.page_table[:2]) == (0, 2)
    cache.free([*a.page_table[2:], *b.page_table[2:]])
    cache.unlock(first.last_node)
    cache.check_integrity()
    assert cache.size_info().device_free_pages == 6


def test_handles_not_held_by_the_caller_are_refused():
    cache = make_cache("lru", device_pages=8)
    serve(cache, tokens(0, 2) + [5])
    with pytest.raises(RuntimeError, match="not in use by a request"):
        cache.free([0])  # owned by the tree
    with pytest.raises(RuntimeError, match="not in use by a request"):
        cache.insert(tokens(50, 1), [7])  # free, never allocated
    with pytest.raises(ValueError, match="1 whole pages need 1 handles, got 2"):
        cache.insert(tokens(50, 1), [6, 7])
    cache.check_integrity()


def test_unlock_without_lock_is_an_error():
    cache = make_cache("lru", device_pages=8)
    serve(cache, tokens(0, 2) + [5])
    with pytest.raises(RuntimeError, match="without a matching lock"):
        cache.unlock(cache.match(tokens(0, 2)).last_node)


def test_admission_beyond_free_plus_evictable_pages_changes_nothing():
    cache = make_cache("penelope", device_pages=4)
    serve(cache, tokens(0, 2) + [5])
    prompt = tokens(100, 5)
    plan = cache.plan(cache.match(prompt[:-1]), len(prompt))
    assert not cache.can_admit(plan)
    with pytest.raises(CacheFullError, match="need 5 device pages, 2 free \\+ 2 evictable"):
        cache.admit(plan)
    cache.check_integrity()
    assert layout(cache, tokens(0, 2)) == [(8, "device")]


def test_reserved_output_pages_are_allocated_with_the_prompt():
    cache = make_cache("penelope", device_pages=8)
    prompt = tokens(0, 1) + [1, 2]
    plan = cache.plan(cache.match(prompt[:-1]), len(prompt))
    admission = cache.admit(plan, reserve_tokens=7)  # 6 + 7 = 13 tokens -> 4 pages
    assert admission.page_table == (0, 1, 2, 3)
    assert cache.size_info().device_in_use_pages == 4


def test_hole_chains_without_kv_below_are_collected():
    cache = make_cache("leaf-head", device_pages=6)
    serve(cache, tokens(0, 2) + [5])
    serve(cache, tokens(0, 2) + tokens(100, 4))
    cache.evict(PAGE, Tier.DEVICE)  # head of the leaf: a hole between the two nodes
    assert layout(cache, tokens(0, 2) + tokens(100, 4)) == [(8, "device"), (4, "hole"), (12, "device")]
    cache.evict(3 * PAGE, Tier.DEVICE)  # the rest of the leaf: the hole has nothing below any more
    cache.check_integrity()
    assert [len(n.tokens) for n in cache.tree.nodes()] == [8]


def two_tier_full():
    """Device 12 pages, host 8 (+2 swap). H1 = 8 pages, then H2, H3 of 4 pages each."""
    cache = make_cache("penelope", device_pages=12, host_pages=8, swap_pages=2)
    for prompt in (tokens(0, 8), tokens(100, 4), tokens(200, 4)):
        serve(cache, prompt)
    return cache


def test_device_victims_move_to_host_while_it_has_room():
    cache = two_tier_full()
    assert layout(cache, tokens(0, 8)) == [(16, "host"), (16, "device")]
    assert cache.size_info().host_cached_pages == 4


def test_one_deletion_order_over_both_tiers_then_moves():
    """Host full: the front of the LRU history is deleted even though it sits on host; then the device
    pages behind it move to host into the room freed."""
    cache = two_tier_full()
    _, admission = serve(cache, tokens(300, 6))
    eviction = admission.eviction
    assert eviction.deleted == {Tier.DEVICE: [], Tier.HOST: [0, 1]}
    assert len(eviction.offloaded) == 6
    assert layout(cache, tokens(0, 8)) == [(8, "hole"), (24, "host")]
    assert layout(cache, tokens(100, 4)) == [(8, "host"), (8, "device")]
    cache.check_integrity()


def test_host_eviction_deletes_host_pages_in_policy_order():
    cache = two_tier_full()
    eviction = cache.evict(3 * PAGE, Tier.HOST)
    cache.check_integrity()
    assert eviction.deleted == {Tier.DEVICE: [], Tier.HOST: [0, 1, 2]}
    assert layout(cache, tokens(0, 8)) == [(12, "hole"), (4, "host"), (16, "device")]


def test_without_a_host_tier_victims_become_holes():
    cache = make_cache("penelope", device_pages=12)
    for prompt in (tokens(0, 8), tokens(100, 4), tokens(200, 4)):
        serve(cache, prompt)
    assert layout(cache, tokens(0, 8)) == [(16, "hole"), (16, "device")]


def test_clock_stamps_matches():
    cache = TieredCache(CacheConfig(device_tokens=16, page_size=4))
    serve(cache, tokens(0, 2) + [1])
    stamp = cache.tick()
    cache.match(tokens(0, 2))
    assert [n.last_access for n in cache.tree.nodes()] == [stamp]


def test_can_admit_counts_the_plans_own_history_as_unevictable():
    """Regression: the plan's matched path gets locked before admit, so it cannot make room for itself."""
    cache = make_cache("penelope", device_pages=6)
    serve(cache, tokens(0, 4) + [5])
    prompt = tokens(0, 4) + tokens(50, 3)  # reuses 4 pages, needs 3 more: only 2 are free
    plan = cache.plan(cache.match(prompt[:-1]), len(prompt))
    assert not cache.can_admit(plan)
    cache.lock(plan.last_node)
    assert not cache.can_admit(plan)
    with pytest.raises(CacheFullError, match="need 3 device pages, 2 free \\+ 0 evictable"):
        cache.admit(plan)
    cache.unlock(plan.last_node)
    cache.check_integrity()


def test_lru_makes_host_room_for_a_whole_node_by_deleting_older_host_kv():
    """lru moves whole nodes; when one outgrows the host room it first deletes the LRU host node, as
    SGLang's host cache would, and only deletes the victim itself when even that is not enough."""
    cache = make_cache("lru", device_pages=12, host_pages=6)
    for prompt in (tokens(0, 8), tokens(100, 4), tokens(200, 4)):
        serve(cache, prompt)
    assert layout(cache, tokens(0, 8)) == []  # 8 pages never fit the 6-page host: deleted
    serve(cache, tokens(300, 6))
    assert layout(cache, tokens(100, 4)) == [(16, "host")]
    _, admission = serve(cache, tokens(400, 4))
    assert admission.eviction.deleted == {Tier.DEVICE: [], Tier.HOST: [0, 1, 2, 3]}
    assert layout(cache, tokens(100, 4)) == []
    assert layout(cache, tokens(200, 4)) == [(16, "host")]


def test_lru_host_room_never_deletes_kv_offloaded_in_the_same_call():
    """Making host room for a whole node must not delete a node whose offload has not run yet."""
    cache = TieredCache(
        CacheConfig(device_tokens=9, host_tokens=2, swap_buffer_tokens=0, eviction_policy="lru")
    )
    serve_page1(cache, [10, 11, 0, 0])
    cache.tick()
    cache.match([10, 11, 0])  # split: [10 11 0] + [0]
    cache.tick()
    cache.match([10, 11])  # split: [10 11] + [0] + [0], stamped 3, 2, 1 from the root
    eviction = cache.evict(3, Tier.DEVICE)
    destinations = [(t.dst_tier, t.dst) for t in eviction.transfers]
    assert len(destinations) == len(set(destinations)), eviction.transfers  # was: host page 0 twice
    assert not set(eviction.deleted[Tier.HOST]) & {t.dst for t in eviction.transfers}
    cache.check_integrity()
