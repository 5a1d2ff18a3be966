"""Stateful property tests of `TieredCache` (backend/cache/cache.py), driven the way an engine drives it.

Sessions share a prefix and mostly append to their last request (often round robin, where LRU hurts
most); sometimes one drops its last pages and continues differently. Requests are started (tick, match
`tokens[:-1]`, plan, lock, admit or unlock when full), kept running, then finished (insert, free the
leftover pages, unlock) or aborted (free own pages, unlock), interleaved with explicit evictions of either
tier. The machine simulates KV memory (`page -> tokens whose KV it holds`) and runs every transfer list
on it. Besides `check_integrity()` after every step, it checks:

- plans tile `[0, num_tokens)`; page tables have one distinct handle per page of prompt + reserve;
- no transfer reads or writes a page an earlier copy in the same list wrote;
- every page the tree holds, in either tier, contains the KV of its tokens;
- a running request's reused and loaded pages stay the tree's device pages at their positions, and every
  page of its page table keeps what it computed or reused; the pages in use are exactly its own;
- right after insert, the request's whole pages match as device KV;
- evictions free what they report, and at least what was asked for when that much is evictable.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from backend.cache import (
    POLICIES,
    Admission,
    CacheConfig,
    CacheFullError,
    Eviction,
    Handle,
    RestorePlan,
    Span,
    Tier,
    TieredCache,
    Transfer,
)
from backend.cache.tree import Node

Tokens = tuple[int, ...]

MAX_RUNNING = 3
SESSION_TAG = 100  # first token after the shared prefix: 100 + session index
SHARED_TOKEN = 10  # shared prefix tokens: 10, 11, ...
token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=8)  # cut to 2 pages (output: 1)


@dataclass
class Running:
    """A request between admission and finish/abort."""

    session: int
    full: Tokens
    """Prompt plus the output it will have produced when it finishes."""
    admission: Admission
    tree_pages: dict[int, Handle]
    """Page index -> device handle for pages the tree owns (reused and loaded segments)."""
    own_pages: list[int]
    """Page indices whose handles the request allocated (phantoms and its own compute)."""

    @property
    def page_table(self) -> tuple[Handle, ...]:
        return self.admission.page_table


def assert_plan_tiles(plan: RestorePlan, page_size: int) -> None:
    """Phantom, reused and load spans plus compute tile [0, num_tokens): no gap, no overlap."""
    spans = sorted(s.span for s in (*plan.reused, *plan.phantoms, *plan.loads))
    position = 0
    for span in spans:
        assert span.start == position, f"gap or overlap at {position}: {plan}"
        assert span.start % page_size == 0 and span.end % page_size == 0, f"unaligned {span}"
        assert span.end > span.start
        position = span.end
    assert plan.compute == Span(position, plan.num_tokens), plan
    assert plan.compute.num_tokens > 0


class CacheMachine(RuleBasedStateMachine):
    """An engine's traffic on one `TieredCache`, with simulated KV memory to check every copy."""

    def __init__(self, policy: str, page_size: int, tiers: str) -> None:
        super().__init__()
        self.policy = policy
        self.page_size = page_size
        self.tiers = tiers
        self.running: list[Running] = []
        self.memory: dict[Tier, dict[Handle, Tokens]] = {Tier.DEVICE: {}, Tier.HOST: {}}

    @initialize(
        device_pages=st.integers(8, 32),
        host_pages=st.integers(2, 12),
        buffer_pages=st.integers(1, 3),
        min_kept_pages=st.sampled_from([0, 2]),
        num_sessions=st.integers(2, 4),
        shared_pages=st.integers(1, 2),
    )
    def setup(
        self,
        device_pages: int,
        host_pages: int,
        buffer_pages: int,
        min_kept_pages: int,
        num_sessions: int,
        shared_pages: int,
    ) -> None:
        ps = self.page_size
        if self.tiers == "device":
            host_pages = buffer_pages = 0
        elif self.tiers == "host":
            buffer_pages = 0
        self.config = CacheConfig(
            device_tokens=device_pages * ps,
            page_size=ps,
            host_tokens=host_pages * ps,
            swap_buffer_tokens=buffer_pages * ps,
            eviction_policy=self.policy,
            min_kept_tokens=max(1, min_kept_pages * ps),
        )
        self.cache = TieredCache(self.config)
        self.max_request_tokens = max(device_pages // 2, 5) * ps  # prompt + reserve
        shared = tuple(range(SHARED_TOKEN, SHARED_TOKEN + shared_pages * ps))
        self.histories: list[Tokens] = [shared + (SESSION_TAG + s,) * ps for s in range(num_sessions)]
        self.session_order = list(range(num_sessions))
        self.root_tokens = len(self.histories[0])

    ##### Simulated memory #####

    def expected(self, tokens: Tokens, page: int) -> Tokens:
        """What page `page` of a request over `tokens` holds: the KV of its tokens and all before."""
        return tokens[: (page + 1) * self.page_size]

    def run_transfers(self, transfers: list[Transfer]) -> None:
        written: set[tuple[Tier, Handle]] = set()
        for t in transfers:
            src, dst = (t.src_tier, t.src), (t.dst_tier, t.dst)
            assert src not in written, f"{t} reads a page overwritten earlier in the same list"
            assert dst not in written, f"{t} writes a page twice in the same list"
            assert t.src in self.memory[t.src_tier], f"{t} reads a page that never held KV"
            self.memory[t.dst_tier][t.dst] = self.memory[t.src_tier][t.src]
            written.add(dst)

    def check_eviction(self, eviction: Eviction, num_loads: int) -> None:
        """Each offloaded page is copied once to host; each load once to the device; nothing else."""
        offloads = [t.src for t in eviction.transfers if t.src_tier is Tier.DEVICE]
        assert sorted(offloads) == sorted(eviction.offloaded)
        assert len(set(offloads)) == len(offloads)
        assert len(eviction.transfers) == len(offloads) + num_loads
        for tier, handles in eviction.deleted.items():
            assert len(set(handles)) == len(handles), f"{tier.value} page deleted twice: {handles}"

    ##### Rules #####

    @precondition(lambda self: len(self.running) < MAX_RUNNING)
    @rule(recency=st.integers(0, 5), new=token_lists, output=token_lists, extra_reserve=st.integers(0, 4))
    def continue_session(self, recency: int, new: list[int], output: list[int], extra_reserve: int) -> None:
        """The common case: a session's next request appends to its last one."""
        session = self.pick_session(recency)
        self.start_request(session, len(self.histories[session]), new, output, extra_reserve)

    @precondition(lambda self: len(self.running) < MAX_RUNNING)
    @rule(
        recency=st.integers(0, 5),
        drop=st.integers(1, 12),
        new=token_lists,
        output=token_lists,
        extra_reserve=st.integers(0, 4),
    )
    def mutate_session(
        self, recency: int, drop: int, new: list[int], output: list[int], extra_reserve: int
    ) -> None:
        """A session drops up to 3 pages of its last request and continues differently."""
        session = self.pick_session(recency)
        keep = max(0, len(self.histories[session]) - 1 - (drop - 1) % (3 * self.page_size))
        self.start_request(session, keep, new, output, extra_reserve)

    def pick_session(self, recency: int) -> int:
        """Sessions by last use, least recent first: recency 0 is round robin, where LRU hurts most."""
        session = self.session_order.pop(recency % len(self.session_order))
        self.session_order.append(session)
        return session

    def start_request(self, session: int, keep: int, new: list[int], output: list[int], extra: int) -> None:
        """tick, match(tokens[:-1]), plan, lock, then admit (or unlock and skip when full)."""
        cache, ps = self.cache, self.page_size
        new, output = new[: 2 * ps], output[:ps]
        reserve = len(output) + extra % (ps + 1)
        if keep + len(new) + reserve > self.max_request_tokens:  # too long: compact to the session's root
            keep = min(self.root_tokens, self.max_request_tokens - len(new) - reserve)
        prompt = self.histories[session][:keep] + tuple(new)
        full = prompt + tuple(output)

        cache.tick()
        match = cache.match(prompt[:-1])
        assert match.num_tokens % ps == 0 and match.num_tokens <= len(prompt) - 1
        plan = cache.plan(match, len(prompt))
        assert_plan_tiles(plan, ps)
        cache.lock(plan.last_node)
        if not cache.can_admit(plan, reserve):
            before = cache.size_info()
            with pytest.raises(CacheFullError):
                cache.admit(plan, reserve)
            assert cache.size_info() == before, "a refused admission changed the cache"
            cache.unlock(plan.last_node)
            return
        admission = cache.admit(plan, reserve)
        self.run_transfers(admission.eviction.transfers)
        self.check_eviction(admission.eviction, num_loads=plan.loaded_tokens // ps)

        table = admission.page_table
        assert len(table) == -(-(len(prompt) + reserve) // ps)
        assert len(set(table)) == len(table), f"page table repeats a handle: {table}"
        tree_pages = {
            page: table[page]
            for segment in (*plan.reused, *plan.loads)
            for page in range(segment.span.start // ps, segment.span.end // ps)
        }
        own_pages = [page for page in range(len(table)) if page not in tree_pages]
        assert len(own_pages) == cache.pages_needed(plan, reserve) - plan.loaded_tokens // ps
        for page, handle in tree_pages.items():
            assert self.memory[Tier.DEVICE].get(handle) == self.expected(prompt, page), (
                f"reused or loaded page {page} (device {handle}) holds the wrong KV"
            )
        for page in own_pages:  # the forward pass: phantoms and the request's own tokens
            self.memory[Tier.DEVICE][table[page]] = self.expected(full, page)
        self.running.append(Running(session, full, admission, tree_pages, own_pages))

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, MAX_RUNNING - 1))
    def finish_request(self, index: int) -> None:
        """insert whole pages, free the leftover pages, unlock; the history is then device KV."""
        cache, ps = self.cache, self.page_size
        request = self.running.pop(index % len(self.running))
        cache.tick()
        whole = len(request.full) // ps
        result = cache.insert(request.full[: whole * ps], request.page_table[:whole])
        own_inserted = sum(1 for page in request.own_pages if page < whole)
        assert result.num_new_pages + result.num_duplicate_pages == own_inserted
        assert cache.match(request.full[: whole * ps]).device_prefix_tokens == whole * ps
        cache.free(request.page_table[whole:])
        cache.unlock(request.admission.plan.last_node)
        self.histories[request.session] = request.full

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, MAX_RUNNING - 1))
    def abort_request(self, index: int) -> None:
        """Free the request's own pages (phantoms and compute), unlock; tree-owned pages stay."""
        request = self.running.pop(index % len(self.running))
        self.cache.free([request.page_table[page] for page in request.own_pages])
        self.cache.unlock(request.admission.plan.last_node)

    @rule(host=st.booleans(), num_tokens=st.integers(1, 16))
    def evict(self, host: bool, num_tokens: int) -> None:
        """Explicit eviction of 1 to 4 pages' worth of tokens from one tier."""
        num_tokens = 1 + (num_tokens - 1) % (4 * self.page_size)
        if host:
            self.evict_host(num_tokens)
        else:
            self.evict_device(num_tokens)

    def evict_device(self, num_tokens: int) -> None:
        """Free at least `num_tokens` of device KV, or everything evictable."""
        before = self.cache.size_info()
        eviction = self.cache.evict(num_tokens, Tier.DEVICE)
        self.run_transfers(eviction.transfers)
        after = self.cache.size_info()
        pages = -(-num_tokens // self.page_size)
        self.check_eviction(eviction, num_loads=0)
        freed = after.device_free_pages - before.device_free_pages
        assert freed == len(eviction.offloaded) + len(eviction.deleted[Tier.DEVICE])
        assert freed >= min(pages, before.device_evictable_pages), (before, after, eviction)
        host_freed = len(eviction.deleted[Tier.HOST]) - len(eviction.offloaded)
        assert after.host_free_pages - before.host_free_pages == host_freed

    def evict_host(self, num_tokens: int) -> None:
        """Free at least `num_tokens` of host KV, or everything evictable there."""
        tree = self.cache.tree
        before = self.cache.size_info()
        evictable = tree.num_cached_pages[Tier.HOST] - tree.num_protected_pages[Tier.HOST]
        eviction = self.cache.evict(num_tokens, Tier.HOST)
        after = self.cache.size_info()
        freed = after.host_free_pages - before.host_free_pages
        assert not eviction.transfers and not eviction.offloaded and not eviction.deleted[Tier.DEVICE]
        assert freed == len(eviction.deleted[Tier.HOST])
        assert freed >= min(-(-num_tokens // self.page_size), evictable)

    @rule()
    def tick(self) -> None:
        self.cache.tick()

    ##### Invariants #####

    @invariant()
    def cache_integrity(self) -> None:
        self.cache.check_integrity()

    @invariant()
    def tree_pages_hold_their_tokens(self) -> None:
        """Every page of the tree, in either tier, holds the KV of its path's tokens."""
        stack: list[tuple[Node, Tokens]] = [(node, ()) for node in self.cache.tree.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            tokens: Tokens = prefix + node.tokens
            if node.tier is not None:
                first = len(prefix) // self.page_size
                for i, handle in enumerate(node.handles):
                    assert self.memory[node.tier].get(handle) == self.expected(tokens, first + i), (
                        f"{node!r} page {i} ({node.tier.value} {handle}) holds the wrong KV"
                    )
            stack.extend((child, tokens) for child in node.children.values())

    @invariant()
    def running_requests_keep_their_pages(self) -> None:
        """Locked pages are never freed, moved or overwritten; own pages are exactly the pages in use."""
        ps = self.page_size
        in_use = 0
        for request in self.running:
            in_use += len(request.own_pages)
            for page, handle in enumerate(request.page_table):
                assert self.memory[Tier.DEVICE].get(handle) == self.expected(request.full, page)
            if not request.tree_pages:
                continue
            end = (max(request.tree_pages) + 1) * ps
            tree_handles: list[Handle | None] = []
            for node, matched in self.cache.tree.walk(request.full[:end]):
                tier_handles = node.handles[:matched] if node.tier is Tier.DEVICE else [None] * matched
                tree_handles.extend(tier_handles)
            assert len(tree_handles) == end // ps, "a running request's path left the tree"
            for page, handle in request.tree_pages.items():
                assert tree_handles[page] == handle, f"locked page {page} was freed or moved"
        assert self.cache.size_info().device_in_use_pages == in_use


STATEFUL_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("tiers", ["device", "host", "swap"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", POLICIES.names())
def test_engine_traffic_keeps_the_cache_consistent(policy: str, page_size: int, tiers: str) -> None:
    """Random sessions of requests, aborts and evictions never break an invariant."""
    machine = lambda: CacheMachine(policy, page_size, tiers)  # noqa: E731
    run_state_machine_as_test(machine, settings=STATEFUL_SETTINGS)  # type: ignore[arg-type]  # any factory
