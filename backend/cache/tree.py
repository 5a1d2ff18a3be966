"""Page-granular radix tree over token ids whose nodes may lose their KV while keeping their tokens.

Each node holds a run of whole pages: `tokens` (a multiple of `page_size` long) and, per page, one KV
handle in a single tier (`Tier.DEVICE` or `Tier.HOST`), or no handles at all (a *hole*: the tokens stay so
that matching can walk through it and find the KV kept after it). Children are keyed by their first page.

    root ─ [shared prefix, DEVICE] ─┬─ [hole] ─ [kept history, DEVICE]      (session A, front evicted)
                                    └─ [history, HOST] ─ [newest, DEVICE]   (session B)

Locks are counted per node along the whole path to the root (`lock_count` of a node = number of running
requests whose matched path contains it), so a locked node's ancestors are locked too. `last_access` is a
stamp from the caller's logical clock.

This module is structure only: walking, splitting at page boundaries, adding and removing nodes, and the
size counters `check_integrity` verifies. Which pages to free is decided by `policies`; handle ownership and
tier moves are done by `cache.TieredCache`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from backend.cache.types import Handle, Tier

PageKey = tuple[int, ...]


class Node:
    """A run of pages. The root has no tokens and is never evicted, split or removed."""

    __slots__ = ("children", "handles", "last_access", "lock_count", "node_id", "parent", "tier", "tokens")

    def __init__(
        self,
        node_id: int,
        parent: Node | None,
        tokens: tuple[int, ...],
        handles: list[Handle],
        tier: Tier | None,
        last_access: int,
    ) -> None:
        self.node_id = node_id
        self.parent = parent
        self.children: dict[PageKey, Node] = {}
        self.tokens = tokens
        self.handles = handles
        self.tier = tier
        self.lock_count = 0
        self.last_access = last_access

    @property
    def is_hole(self) -> bool:
        return self.tier is None and self.parent is not None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        where = self.tier.value if self.tier else "hole"
        return f"Node#{self.node_id}({len(self.tokens)} tok, {where}, lock={self.lock_count})"


class RadixTree:
    """Nodes, their page-aligned splits and the per-tier page counters (cached and lock-protected)."""

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._next_id = 0
        self.root = self._new_node(None, (), [], None, 0)
        self.num_cached_pages = {Tier.DEVICE: 0, Tier.HOST: 0}
        self.num_protected_pages = {Tier.DEVICE: 0, Tier.HOST: 0}

    ##### Walking #####

    def page_key(self, tokens: Sequence[int], page: int = 0) -> PageKey:
        start = page * self.page_size
        return tuple(tokens[start : start + self.page_size])

    def walk(self, tokens: Sequence[int]) -> list[tuple[Node, int]]:
        """Nodes matched by `tokens` (whole pages only) with the number of pages matched in each.

        Does not mutate. Every node but the last is matched whole; the last may be matched partly.
        """
        path: list[tuple[Node, int]] = []
        tokens = tuple(tokens)  # once, so that page comparisons are tuple slices
        node = self.root
        num_pages = len(tokens) // self.page_size
        page = 0
        while page < num_pages:
            child = node.children.get(self.page_key(tokens, page))
            if child is None:
                break
            matched = self.count_matching_pages(child, tokens, page, num_pages)
            path.append((child, matched))
            page += matched
            if matched < self.num_pages(child):
                break
            node = child
        return path

    def count_matching_pages(self, node: Node, tokens: Sequence[int], page: int, num_pages: int) -> int:
        """Whole pages of `node` that `tokens` matches from page `page` on (at most `num_pages` total)."""
        size, start = self.page_size, page * self.page_size
        limit = min(self.num_pages(node), num_pages - page)

        def agree(pages: int) -> bool:
            span = pages * size
            theirs = node.tokens if span == len(node.tokens) else node.tokens[:span]
            return tuple(tokens[start : start + span]) == theirs

        if agree(limit):
            return limit
        matched, mismatched = 0, limit  # binary search: slice comparisons run in C
        while mismatched - matched > 1:
            middle = (matched + mismatched) // 2
            if agree(middle):
                matched = middle
            else:
                mismatched = middle
        return matched

    def path_to_root(self, node: Node) -> list[Node]:
        """`node` and its ancestors, deepest first, without the root."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path

    def start_position(self, node: Node) -> int:
        """Absolute token position of the node's first token."""
        return sum(len(n.tokens) for n in self.path_to_root(node)) - len(node.tokens)

    def nodes(self) -> Iterator[Node]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes() if n.is_leaf]

    ##### Structure changes #####

    def num_pages(self, node: Node) -> int:
        return len(node.tokens) // self.page_size

    def split(self, node: Node, num_head_pages: int) -> Node:
        """Split `node` after its first `num_head_pages` pages and return the new head node.

        The original object keeps the tail, so whoever holds it (a running request's lock) still holds the
        deepest part. The head inherits the lock count and access stamp.
        """
        if not 0 < num_head_pages < self.num_pages(node):
            raise ValueError(f"cannot split {node!r} after {num_head_pages} pages")
        parent = node.parent
        assert parent is not None, "the root is never split"
        cut = num_head_pages * self.page_size
        head_handles = node.handles[:num_head_pages]
        node.handles = node.handles[num_head_pages:]
        head = self._new_node(parent, node.tokens[:cut], head_handles, node.tier, node.last_access)
        head.lock_count = node.lock_count
        node.tokens = node.tokens[cut:]
        parent.children[self.page_key(head.tokens)] = head
        head.children[self.page_key(node.tokens)] = node
        node.parent = head
        return head

    def add_leaf(
        self, parent: Node, tokens: tuple[int, ...], handles: list[Handle], tier: Tier | None, stamp: int
    ) -> Node:
        node = self._new_node(parent, tokens, [], None, stamp)
        parent.children[self.page_key(tokens)] = node
        self.set_kv(node, tier, handles)
        return node

    def remove_leaf(self, node: Node) -> None:
        if node.children or node.lock_count or node.parent is None:
            raise RuntimeError(f"only an unlocked leaf can be removed, got {node!r}")
        self.set_kv(node, None, [])
        del node.parent.children[self.page_key(node.tokens)]
        node.parent = None

    def merge_into_child(self, node: Node) -> Node:
        """Fold a single-child `node` into that child (used to coalesce adjacent holes); returns the child."""
        (child,) = node.children.values()
        parent = node.parent
        assert parent is not None and not node.handles and not child.handles
        del parent.children[self.page_key(node.tokens)]
        child.tokens = node.tokens + child.tokens
        child.last_access = max(child.last_access, node.last_access)
        child.parent = parent
        parent.children[self.page_key(child.tokens)] = child
        node.parent = None
        node.children = {}
        return child

    def set_kv(self, node: Node, tier: Tier | None, handles: list[Handle]) -> None:
        """Give `node` new KV (or make it a hole), keeping the page counters exact."""
        if tier is not None and len(handles) != self.num_pages(node):
            raise RuntimeError(f"{node!r} has {self.num_pages(node)} pages but got {len(handles)} handles")
        if tier is None and handles:
            raise RuntimeError("a hole holds no handles")
        self._count(node, -1)
        node.tier = tier
        node.handles = list(handles)
        self._count(node, +1)

    def add_lock(self, node: Node, delta: int) -> None:
        """Add `delta` (+1 or -1) to the lock count of `node` and all its ancestors."""
        for n in self.path_to_root(node):
            if n.lock_count + delta < 0:
                raise RuntimeError(f"unlock of {n!r} that is not locked")
            if n.tier is not None and (n.lock_count == 0) != (n.lock_count + delta == 0):
                self.num_protected_pages[n.tier] += delta * len(n.handles)
            n.lock_count += delta

    def _count(self, node: Node, sign: int) -> None:
        if node.tier is None:
            return
        self.num_cached_pages[node.tier] += sign * len(node.handles)
        if node.lock_count:
            self.num_protected_pages[node.tier] += sign * len(node.handles)

    def _new_node(
        self,
        parent: Node | None,
        tokens: tuple[int, ...],
        handles: list[Handle],
        tier: Tier | None,
        stamp: int,
    ) -> Node:
        self._next_id += 1
        return Node(self._next_id, parent, tokens, handles, tier, stamp)
