"""Eviction policies: which pages of the tree to free next. They decide; `TieredCache` applies.

A policy hands out a `VictimSelector` for one eviction call over a set of tiers. The cache asks it for the
next victim (a contiguous run of pages inside one node), applies it (split, move or free, garbage
collection), and asks again until enough pages are free. Selectors skip locked nodes. Ties in access
stamps are broken by node id (creation order), so every order here is deterministic.

Policies (names as selected in `CacheConfig.eviction_policy`):

- `lru`: SGLang's radix cache. Take the least recently used *tier leaf* (a node whose KV is in the
  tiers and none below it is) and free the whole node: the tail of the history, often more than needed.
  When its parent becomes a tier leaf it joins the candidates.
- `lru-block`: the same leaf, but only the pages needed, from the node's tail.
- `leaf-head`: the same leaf, only the pages needed, from the node's head (the paper's ablation).
- `penelope`: take the least recently used leaf of the tree (a history's newest node) and walk toward
  the root to the earliest deletable node of this private history; stop when the parent is the root,
  has several children (a shared prefix), is locked by a running request, or is already a hole. From
  there free only the leading pages needed; if that node has no KV in the tiers (or is used up), continue
  toward the leaf, then to the next least recently used history. Deleting the front of a history costs
  the least to recompute: a token at position p costs `linear + p` (see `cost`).
"""

from __future__ import annotations

import abc
import heapq
from collections.abc import Callable
from typing import ClassVar, NamedTuple

from backend.cache.tree import Node, RadixTree
from backend.cache.types import Tier


class Victim(NamedTuple):
    """Pages `[first_page, first_page + num_pages)` of `node` to free or move."""

    node: Node
    first_page: int
    num_pages: int


class VictimSelector(abc.ABC):
    """One eviction call's iterator over victims; valid while only its own victims change the tree."""

    @abc.abstractmethod
    def next_victim(self, num_pages: int) -> Victim | None:
        """Next victim for a need of `num_pages` (> 0), or None when nothing evictable is left.

        Whole-node policies may return more pages than asked for. Does not mutate the tree: the caller
        applies the victim before asking again.
        """


class EvictionPolicy(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def selector(self, tree: RadixTree, tiers: frozenset[Tier]) -> VictimSelector:
        """A selector over the KV held in `tiers` (device, host or both)."""


class Registry:
    """Policies by name; registering a duplicate or looking up an unknown name raises ValueError."""

    def __init__(self) -> None:
        self._policies: dict[str, type[EvictionPolicy]] = {}

    def register(self, cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if not cls.name or cls.name in self._policies:
            raise ValueError(f"eviction policy name {cls.name!r} is empty or already registered")
        self._policies[cls.name] = cls
        return cls

    def create(self, name: str) -> EvictionPolicy:
        if name not in self._policies:
            raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(self.names())}")
        return self._policies[name]()

    def names(self) -> list[str]:
        return list(self._policies)


POLICIES = Registry()


##### LRU over tier leaves: lru, lru-block, leaf-head #####


class _TierLeafSelector(VictimSelector):
    """Least recently used tier leaves first; a parent joins once its last tier child is used up."""

    def __init__(
        self, tree: RadixTree, tiers: frozenset[Tier], take: Callable[[Node, int, int], Victim]
    ) -> None:
        self._tiers = tiers
        self._take = take
        self._tree = tree
        self._below: dict[int, int] = {}  # node_id -> number of nodes in `tiers` strictly below it
        self._heap: list[tuple[int, int, Node]] = []
        for node in reversed(list(tree.nodes())):  # children before parents
            below = sum(self._below[c.node_id] + (c.tier in tiers) for c in node.children.values())
            self._below[node.node_id] = below
            self._push_if_leaf(node)

    def _push_if_leaf(self, node: Node) -> None:
        if node.tier in self._tiers and not node.lock_count and not self._below.get(node.node_id, 0):
            heapq.heappush(self._heap, (node.last_access, node.node_id, node))

    def next_victim(self, num_pages: int) -> Victim | None:
        while self._heap:
            _, _, node = heapq.heappop(self._heap)
            if node.parent is None or node.tier not in self._tiers or node.lock_count:
                continue
            victim = self._take(node, self._tree.num_pages(node), num_pages)
            if victim.num_pages == self._tree.num_pages(node):
                for ancestor in self._tree.path_to_root(node)[1:]:
                    self._below[ancestor.node_id] -= 1
                    self._push_if_leaf(ancestor)  # the nearest tier ancestor may lie above holes
            return victim
        return None


@POLICIES.register
class LRU(EvictionPolicy):
    name = "lru"

    def selector(self, tree: RadixTree, tiers: frozenset[Tier]) -> VictimSelector:
        return _TierLeafSelector(tree, tiers, lambda node, pages, need: Victim(node, 0, pages))


@POLICIES.register
class LRUBlock(EvictionPolicy):
    name = "lru-block"

    def selector(self, tree: RadixTree, tiers: frozenset[Tier]) -> VictimSelector:
        def take_tail(node: Node, pages: int, need: int) -> Victim:
            num = min(pages, need)
            return Victim(node, pages - num, num)

        return _TierLeafSelector(tree, tiers, take_tail)


@POLICIES.register
class LeafHead(EvictionPolicy):
    name = "leaf-head"

    def selector(self, tree: RadixTree, tiers: frozenset[Tier]) -> VictimSelector:
        return _TierLeafSelector(tree, tiers, lambda node, pages, need: Victim(node, 0, min(pages, need)))


##### Penelope #####


class _PenelopeSelector(VictimSelector):
    """Histories in LRU order of their leaf; inside one, the earliest deletable pages first."""

    def __init__(self, tree: RadixTree, tiers: frozenset[Tier]) -> None:
        self._tree = tree
        self._tiers = tiers
        self._current: Node | None = None
        self._exhausted: set[int] = set()
        self._fallback: VictimSelector | None = None

    def next_victim(self, num_pages: int) -> Victim | None:
        while self._fallback is None:
            if self._current is not None and self._current.parent is not None and self._current.is_leaf:
                node = self._first_deletable(self._current)
                if node is not None:
                    return Victim(node, 0, min(num_pages, self._tree.num_pages(node)))
                self._exhausted.add(self._current.node_id)
            self._current = self._next_history()
            if self._current is None:
                # Left: shared nodes whose histories below hold no KV in `tiers` (it moved to the other
                # tier). No walk from a leaf reaches them; take them as tier leaves, head first.
                self._fallback = _TierLeafSelector(
                    self._tree, self._tiers, lambda node, pages, need: Victim(node, 0, min(pages, need))
                )
        return self._fallback.next_victim(num_pages)

    def _next_history(self) -> Node | None:
        leaves = [n for n in self._tree.leaves() if n.node_id not in self._exhausted and not n.lock_count]
        return min(leaves, key=lambda n: (n.last_access, n.node_id), default=None)

    def _first_deletable(self, leaf: Node) -> Node | None:
        chain = [leaf]  # from the leaf up to the earliest deletable node of the private history
        while True:
            parent = chain[-1].parent
            assert parent is not None
            if parent.parent is None or len(parent.children) > 1 or parent.lock_count or parent.is_hole:
                break
            chain.append(parent)
        for node in reversed(chain):
            if node.tier in self._tiers and not node.lock_count:
                return node
        return None


@POLICIES.register
class Penelope(EvictionPolicy):
    name = "penelope"

    def selector(self, tree: RadixTree, tiers: frozenset[Tier]) -> VictimSelector:
        return _PenelopeSelector(tree, tiers)
