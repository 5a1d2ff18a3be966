"""`TieredCache`: the cache-policy core's facade over one radix tree, two tiers and a policy.

A request's life, as engine and simulator drive it:

    match(tokens[:-1]) -> plan(match, len(tokens)) -> lock(plan.last_node) -> admit(plan)
        -> (adapter runs admission.transfers, then computes phantoms + own tokens)
        -> insert(tokens, page_table[:full pages]) -> free(leftover pages) -> unlock(plan.last_node)

The core owns page bookkeeping: which device and host handles are free, cached in the tree, or in use by
a running request (allocated, not yet inserted), plus the host swap buffer. Eviction runs in two phases so
that a move never causes an extra deletion:

1. Deletion. To gain R device pages with F free host pages (plus, when a swap buffer exists, the L host
   pages this admission's loads release), D = max(0, R - F - L) pages are deleted in the policy's order
   over *both* tiers (one deletion order): each victim becomes a hole, freeing device or host pages.
2. Moves. The remaining R - D_device pages are chosen in the policy's order over the device tier and
   offloaded to host pages freed above. Only whole-node victims (`lru`) can outgrow that room; for
   them host victims are deleted first, as SGLang's host cache does, and if that is not enough the
   victim itself is deleted.

`swap.order_transfers` then orders the page copies, using the swap buffer when both tiers are full.
Holes whose subtree holds no KV are garbage-collected; adjacent unlocked holes are coalesced. Every
method that changes state says so; `check_integrity()` verifies all invariants (tests call it after every
operation). The clock is logical: `tick()` advances it, matches and inserts stamp nodes with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from backend.cache.config import CacheConfig
from backend.cache.policies import POLICIES, Victim
from backend.cache.restore import MatchResult, RestorePlan, Segment, plan_restore
from backend.cache.swap import Transfer, order_transfers
from backend.cache.tree import Node, RadixTree
from backend.cache.types import Handle, Span, Tier


class CacheFullError(RuntimeError):
    """An admission needs more device pages than are free or evictable (running requests hold them)."""


@dataclass(slots=True)
class Eviction:
    """What one eviction or admission did to the tiers. Adapters run `transfers` in order."""

    transfers: list[Transfer] = field(default_factory=list)
    deleted: dict[Tier, list[Handle]] = field(default_factory=lambda: {tier: [] for tier in Tier})
    """Pages whose KV is gone (their nodes became holes), per tier, in victim order."""
    offloaded: list[Handle] = field(default_factory=list)
    """Device pages whose KV moved to host; free once their transfer has run."""


class Admission(NamedTuple):
    plan: RestorePlan
    page_table: tuple[Handle, ...]
    """Device handle of every page of `[0, num_tokens + reserve_tokens)`, in position order."""
    eviction: Eviction


class InsertResult(NamedTuple):
    num_new_pages: int
    """Pages that entered the tree as device KV (new leaves, filled holes, replaced host copies)."""
    num_duplicate_pages: int
    """Request pages already cached on the device by someone else: freed back to the pool."""


class SizeInfo(NamedTuple):
    device_free_pages: int
    device_cached_pages: int
    device_protected_pages: int
    device_in_use_pages: int
    host_free_pages: int
    host_cached_pages: int

    @property
    def device_evictable_pages(self) -> int:
        return self.device_cached_pages - self.device_protected_pages


class TieredCache:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.policy = POLICIES.create(config.eviction_policy)
        self.tree = RadixTree(config.page_size)
        self.now = 0
        # Free lists are stacks popped from the end, so handles are handed out in increasing order.
        self._free = {
            Tier.DEVICE: [Handle(i) for i in reversed(range(config.device_pages))],
            Tier.HOST: [Handle(i) for i in reversed(range(config.host_pages))],
        }
        extra = range(config.host_pages, config.host_pages + config.swap_buffer_pages)
        self._buffer = [Handle(i) for i in extra]
        self._in_use: set[Handle] = set()
        self._direct_locks: Counter[int] = Counter()

    ##### Public API #####

    def tick(self) -> int:
        """Advance the logical clock by one and return it."""
        self.now += 1
        return self.now

    def match(self, tokens: Sequence[int]) -> MatchResult:
        """Longest whole-page match of `tokens`, through holes and host segments.

        Mutates: splits the last matched node at the match end and stamps matched nodes with `now`.
        """
        path = self.tree.walk(tokens)
        if path and path[-1][1] < self.tree.num_pages(path[-1][0]):
            path[-1] = (self.tree.split(path[-1][0], path[-1][1]), path[-1][1])
        segments: list[Segment] = []
        position = 0
        for node, _ in path:
            node.last_access = self.now
            end = position + len(node.tokens)
            if segments and segments[-1].tier is node.tier:
                last = segments[-1]
                segments[-1] = Segment(last.tier, Span(last.span.start, end), (*last.nodes, node))
            else:
                segments.append(Segment(node.tier, Span(position, end), (node,)))
            position = end
        device_prefix = segments[0].span.end if segments and segments[0].tier is Tier.DEVICE else 0
        last_node = path[-1][0] if path else self.tree.root
        return MatchResult(position, device_prefix, tuple(segments), last_node)

    def plan(self, match: MatchResult, num_tokens: int) -> RestorePlan:
        """Restore plan for a prompt of `num_tokens` (see `restore.plan_restore`). Does not mutate."""
        return plan_restore(match, num_tokens, self.config.min_kept_tokens)

    def lock(self, node: Node) -> None:
        """Protect `node` and its ancestors from eviction until `unlock`."""
        self.tree.add_lock(node, +1)
        self._direct_locks[node.node_id] += 1

    def unlock(self, node: Node) -> None:
        """Release a `lock`; garbage-collects the node if it is a hole with nothing below."""
        if self._direct_locks[node.node_id] <= 0:
            raise RuntimeError(f"unlock of {node!r} without a matching lock")
        self._direct_locks[node.node_id] -= 1
        if not self._direct_locks[node.node_id]:
            del self._direct_locks[node.node_id]
        self.tree.add_lock(node, -1)
        self._tidy(node)

    def pages_needed(self, plan: RestorePlan, reserve_tokens: int = 0) -> int:
        """Device pages an admission of `plan` allocates (phantoms, loads and the request's own pages)."""
        total = -(-(plan.num_tokens + reserve_tokens) // self.page_size)
        own = total - plan.compute.start // self.page_size
        return own + (plan.recomputed_tokens + plan.loaded_tokens) // self.page_size

    def can_admit(self, plan: RestorePlan, reserve_tokens: int = 0) -> bool:
        """Whether `admit` would find the pages; counts the plan's own path as locked. Does not mutate."""
        return self.pages_needed(plan, reserve_tokens) <= self._available_pages(plan.last_node)

    def _available_pages(self, last_node: Node) -> int:
        info = self.size_info()
        own = sum(
            len(n.handles)
            for n in self.tree.path_to_root(last_node)
            if n.tier is Tier.DEVICE and not n.lock_count
        )
        return info.device_free_pages + info.device_evictable_pages - own

    def admit(self, plan: RestorePlan, reserve_tokens: int = 0) -> Admission:
        """Allocate device pages for `plan` (+ `reserve_tokens` of output), evicting as needed.

        `plan.last_node` must be locked and the plan fresh (made since the last mutation). Mutates:
        evicts, converts loaded host segments to device KV, marks new pages in use. Raises
        CacheFullError (changing nothing) if the pages cannot be found.
        """
        if plan.last_node is not self.tree.root and not plan.last_node.lock_count:
            raise RuntimeError("admit() needs plan.last_node locked")
        need = self.pages_needed(plan, reserve_tokens)
        if not self.can_admit(plan, reserve_tokens):
            info = self.size_info()
            raise CacheFullError(
                f"need {need} device pages, {info.device_free_pages} free + "
                f"{self._available_pages(plan.last_node) - info.device_free_pages} evictable"
            )
        load_nodes = [node for segment in plan.loads for node in segment.nodes]
        eviction = self._make_room(need, load_nodes)
        table: list[Handle] = []
        for segment in sorted((*plan.reused, *plan.phantoms, *plan.loads), key=lambda s: s.span.start):
            pages = segment.span.num_tokens // self.page_size
            table.extend(self._allocate(pages) if segment.tier is None else segment.handles)
        table.extend(self._allocate(need - len(table) + plan.cached_tokens // self.page_size))
        return Admission(plan, tuple(table), eviction)

    def insert(self, tokens: Sequence[int], handles: Sequence[Handle]) -> InsertResult:
        """Cache the whole pages of `tokens` with device `handles` (one per whole page).

        Handles the tree already holds at the same place are no-ops; other pages must be in use by the
        caller. Mutates: adds a leaf, fills holes, replaces host copies (freeing them), frees duplicates,
        stamps the path with `now`. Pages beyond the whole pages of `tokens` stay in use: `free` them.
        """
        num_pages = len(tokens) // self.page_size
        if len(handles) != num_pages:
            raise ValueError(f"{num_pages} whole pages need {num_pages} handles, got {len(handles)}")
        node, page, new, dup = self.tree.root, 0, 0, 0
        while page < num_pages:
            child = node.children.get(self.tree.page_key(tokens, page))
            if child is None:
                taken = self._take_in_use(handles[page:])
                start = page * self.page_size
                self.tree.add_leaf(
                    node, tuple(tokens[start : num_pages * self.page_size]), taken, Tier.DEVICE, self.now
                )
                new += len(taken)
                break
            matched = self.tree.count_matching_pages(child, tokens, page, num_pages)
            if matched < self.tree.num_pages(child):
                child = self.tree.split(child, matched)
            added, duplicated = self._adopt(child, handles[page : page + matched])
            new, dup = new + added, dup + duplicated
            child.last_access = self.now
            node, page = child, page + matched
        return InsertResult(new, dup)

    def free(self, handles: Sequence[Handle]) -> None:
        """Return device pages the caller holds in use (never inserted) to the free pool."""
        self._take_in_use(handles)
        self._free[Tier.DEVICE].extend(handles)

    def evict(self, num_tokens: int, tier: Tier) -> Eviction:
        """Free at least `num_tokens` (whole pages, rounded up) in `tier` if that much is evictable.

        Device: deletes or offloads in the two-phase order; host: deletes host pages (they become holes).
        Mutates. Returns what was done; freed handles are back in the core's free pools.
        """
        num_pages = -(-num_tokens // self.page_size)
        if tier is Tier.HOST:
            eviction = Eviction()
            self._delete(num_pages, frozenset({Tier.HOST}), eviction)
            return eviction
        return self._make_room(len(self._free[Tier.DEVICE]) + num_pages, [])

    def size_info(self) -> SizeInfo:
        return SizeInfo(
            device_free_pages=len(self._free[Tier.DEVICE]),
            device_cached_pages=self.tree.num_cached_pages[Tier.DEVICE],
            device_protected_pages=self.tree.num_protected_pages[Tier.DEVICE],
            device_in_use_pages=len(self._in_use),
            host_free_pages=len(self._free[Tier.HOST]),
            host_cached_pages=self.tree.num_cached_pages[Tier.HOST],
        )

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first broken invariant. Does not mutate."""
        owned: dict[Tier, list[Handle]] = {Tier.DEVICE: [], Tier.HOST: []}
        counted = Counter[Tier]()
        protected = Counter[Tier]()
        for node in self.tree.nodes():
            self._check_node(node)
            if node.tier is not None:
                owned[node.tier].extend(node.handles)
                counted[node.tier] += len(node.handles)
                if node.lock_count:
                    protected[node.tier] += len(node.handles)
        for tier in Tier:
            cached, locked = self.tree.num_cached_pages[tier], self.tree.num_protected_pages[tier]
            if (counted[tier], protected[tier]) != (cached, locked):
                raise RuntimeError(
                    f"{tier.value}: counters say {cached} cached / {locked} locked pages, "
                    f"the tree holds {counted[tier]} / {protected[tier]}"
                )
        device = owned[Tier.DEVICE] + self._free[Tier.DEVICE] + sorted(self._in_use)
        self._check_partition("device", device, self.config.device_pages)
        host = owned[Tier.HOST] + self._free[Tier.HOST] + self._buffer
        self._check_partition("host", host, self.config.host_pages + self.config.swap_buffer_pages)
        if len(self._buffer) != self.config.swap_buffer_pages:
            raise RuntimeError(
                f"swap buffer holds {len(self._buffer)} pages, expected {self.config.swap_buffer_pages}"
            )

    ##### Internal helpers #####

    def _check_node(self, node: Node) -> None:
        parent = node.parent
        if parent is None or parent.children.get(self.tree.page_key(node.tokens)) is not node:
            raise RuntimeError(f"{node!r} is not linked under its parent by its first page")
        if not node.tokens or len(node.tokens) % self.page_size:
            raise RuntimeError(
                f"{node!r} holds {len(node.tokens)} tokens, not a positive number of whole pages"
            )
        if node.tier is not None and len(node.handles) != self.tree.num_pages(node):
            raise RuntimeError(
                f"{node!r} has {len(node.handles)} handles for {self.tree.num_pages(node)} pages"
            )
        if node.tier is None and node.handles:
            raise RuntimeError(f"hole {node!r} holds handles")
        if node.tier is None and node.is_leaf and not node.lock_count:
            raise RuntimeError(f"hole {node!r} has no KV below it and should have been collected")
        below = sum(c.lock_count for c in node.children.values())
        if node.lock_count != self._direct_locks[node.node_id] + below:
            raise RuntimeError(
                f"{node!r}: lock count != own locks {self._direct_locks[node.node_id]} + children {below}"
            )
        if node.last_access > self.now:
            raise RuntimeError(f"{node!r} was stamped {node.last_access}, after the clock {self.now}")

    @staticmethod
    def _check_partition(tier: str, handles: list[Handle], capacity: int) -> None:
        if len(handles) != capacity or set(handles) != set(range(capacity)):
            counts = Counter(handles)
            doubled = sorted(h for h, c in counts.items() if c > 1)[:5]
            missing = sorted(set(range(capacity)) - set(handles))[:5]
            raise RuntimeError(
                f"{tier}: free + cached + in use = {len(handles)} pages, capacity {capacity}; "
                f"owned twice {doubled}, leaked {missing}"
            )

    def _allocate(self, num_pages: int) -> list[Handle]:
        free = self._free[Tier.DEVICE]
        if num_pages > len(free):
            raise RuntimeError(
                f"allocating {num_pages} device pages with {len(free)} free: eviction sized wrongly"
            )
        taken = [free.pop() for _ in range(num_pages)]
        self._in_use.update(taken)
        return taken

    def _take_in_use(self, handles: Sequence[Handle]) -> list[Handle]:
        taken = []
        for handle in handles:
            if handle not in self._in_use:
                raise RuntimeError(
                    f"device page {handle} is not in use by a request (freed twice or not ours)"
                )
            self._in_use.remove(handle)
            taken.append(handle)
        return taken

    def _adopt(self, node: Node, handles: Sequence[Handle]) -> tuple[int, int]:
        """Let an inserting request's pages become `node`'s KV, or free them if `node` has device KV."""
        if node.tier is Tier.DEVICE:
            duplicates = [h for own, h in zip(node.handles, handles, strict=True) if h != own]
            self.free(duplicates)
            return 0, len(duplicates)
        taken = self._take_in_use(handles)
        if node.tier is Tier.HOST:
            self._free[Tier.HOST].extend(node.handles)
        self.tree.set_kv(node, Tier.DEVICE, taken)
        return len(taken), 0

    def _make_room(self, need_pages: int, load_nodes: list[Node]) -> Eviction:
        """Free device pages until `need_pages` are free, then turn `load_nodes` into device KV."""
        eviction = Eviction()
        free_device, free_host = self._free[Tier.DEVICE], self._free[Tier.HOST]
        # Host pages our own loads release can take offloads, through the swap buffer.
        load_host = [h for node in load_nodes for h in node.handles] if self._buffer else []
        shortfall = need_pages - len(free_device)
        if shortfall > len(free_host) + len(load_host):
            tiers = frozenset(Tier) if self.config.host_pages else frozenset({Tier.DEVICE})
            self._delete(shortfall - len(free_host) - len(load_host), tiers, eviction)
        moves = self._move(need_pages - len(free_device), load_host, eviction)
        used_load_host = {h for _, _, h in moves}
        loads: list[tuple[Handle, Handle]] = []
        for node in load_nodes:
            fresh = [free_device.pop() for _ in node.handles]
            loads.extend(zip(node.handles, fresh, strict=True))
            free_host.extend(h for h in node.handles if h not in used_load_host)
            self.tree.set_kv(node, Tier.DEVICE, fresh)
        eviction.transfers, renamed = order_transfers([(d, h) for _, d, h in moves], loads, self._buffer)
        if renamed:
            for node in {id(node): node for node, _, _ in moves}.values():
                self.tree.set_kv(node, Tier.HOST, [renamed.get(h, h) for h in node.handles])
        return eviction

    def _move(
        self, num_pages: int, load_host: list[Handle], eviction: Eviction
    ) -> list[tuple[Node, Handle, Handle]]:
        """Offload `num_pages` device pages to host in policy order (see the module docstring)."""
        moves: list[tuple[Node, Handle, Handle]] = []
        free_host = self._free[Tier.HOST]
        reserve = list(reversed(load_host))
        selector = self.policy.selector(self.tree, frozenset({Tier.DEVICE}))
        while num_pages > 0:
            victim = selector.next_victim(num_pages)
            if victim is None:
                break
            node = self._isolate(victim)
            pages = len(node.handles)
            if pages > len(free_host) + len(reserve):
                # Only whole-node victims (lru) outgrow the room phase 1 made. Like SGLang's host
                # cache, make room by deleting host victims in the policy's order; else delete it.
                # Nodes offloaded earlier in this call are not victims: their copies have not run.
                pending = list({id(n): n for n, _, _ in moves}.values())
                for moved in pending:
                    self.tree.add_lock(moved, +1)
                self._delete(pages - len(free_host) - len(reserve), frozenset({Tier.HOST}), eviction)
                for moved in pending:
                    self.tree.add_lock(moved, -1)
            if pages > len(free_host) + len(reserve):
                self._delete_node(node, eviction)
            else:
                homes = [free_host.pop() if free_host else reserve.pop() for _ in range(pages)]
                moves.extend((node, d, h) for d, h in zip(node.handles, homes, strict=True))
                self._free[Tier.DEVICE].extend(node.handles)
                eviction.offloaded.extend(node.handles)
                self.tree.set_kv(node, Tier.HOST, homes)
            num_pages -= pages
        return moves

    def _delete(self, num_pages: int, tiers: frozenset[Tier], eviction: Eviction) -> None:
        selector = self.policy.selector(self.tree, tiers)
        while num_pages > 0:
            victim = selector.next_victim(num_pages)
            if victim is None:
                return
            num_pages -= self._delete_node(self._isolate(victim), eviction)

    def _delete_node(self, node: Node, eviction: Eviction) -> int:
        tier = node.tier
        assert tier is not None
        pages = len(node.handles)
        self._free[tier].extend(node.handles)
        eviction.deleted[tier].extend(node.handles)
        self.tree.set_kv(node, None, [])
        self._tidy(node)
        return pages

    def _isolate(self, victim: Victim) -> Node:
        """Split the victim's pages into a node of their own and return it."""
        node, first, num = victim
        total = self.tree.num_pages(node)
        if num == total:
            return node
        if first == 0:
            return self.tree.split(node, num)
        self.tree.split(node, first)
        return node

    def _tidy(self, node: Node) -> None:
        """Collect unlocked holes with no KV below; coalesce an unlocked hole with hole neighbours."""
        if node.parent is None or not node.is_hole or node.lock_count:
            return
        if node.is_leaf:
            doomed: Node | None = node
            while doomed is not None and doomed.is_hole and doomed.is_leaf and not doomed.lock_count:
                parent = doomed.parent
                self.tree.remove_leaf(doomed)
                doomed = parent
            return
        if len(node.children) == 1:
            (child,) = node.children.values()
            if child.is_hole and not child.lock_count:
                node = self.tree.merge_into_child(node)
        parent = node.parent
        assert parent is not None
        if parent.is_hole and not parent.lock_count and len(parent.children) == 1:
            self.tree.merge_into_child(parent)
