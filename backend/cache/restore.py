"""Match results and restore plans: how a request reuses, reloads and recomputes a cached history.

A match walks the tree as long as whole pages of the request's tokens agree, through holes and host
segments alike, and reports the matched run as ordered segments:

    positions  0 ........................................................ num_tokens
    segments   | device (shared) | hole | host | device | hole |  (not cached)  |
    plan       |     reused      |phantom| load | reused |   request computes    |
                                                        ^ compute.start

The plan keeps every cached segment up to the last one *worth keeping*: one followed by no hole, or
whose cached tokens after the last hole before it number at least `min_kept_tokens`. Holes before that
point are recomputed in place by a phantom segment (same tokens, original positions, no output) in the
same batch as the request; host segments are loaded to the device; a hole at the end is simply part of
the request's own prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from backend.cache.tree import Node
from backend.cache.types import Handle, Span, Tier


class Segment(NamedTuple):
    """A run of matched nodes in one tier (`None`: a hole) covering `span`."""

    tier: Tier | None
    span: Span
    nodes: tuple[Node, ...]

    @property
    def handles(self) -> list[Handle]:
        return [h for node in self.nodes for h in node.handles]


class MatchResult(NamedTuple):
    num_tokens: int
    """Matched tokens (whole pages) through device, host and hole segments."""
    device_prefix_tokens: int
    """Leading matched tokens whose KV is on the device: what plain prefix caching would reuse."""
    segments: tuple[Segment, ...]
    last_node: Node
    """Deepest matched node (the root when nothing matched): lock it while the request runs."""


@dataclass(frozen=True, slots=True)
class RestorePlan:
    num_tokens: int
    """Prompt length of the request."""
    reused: tuple[Segment, ...]
    """Device segments read as they are."""
    phantoms: tuple[Segment, ...]
    """Holes recomputed at their original positions, producing no output."""
    loads: tuple[Segment, ...]
    """Host segments copied to the device before the request's forward pass."""
    compute: Span
    """The request's own tokens: from the end of the kept history to the end of the prompt."""
    last_node: Node
    """The match's deepest node, which the request must hold locked from before admission to insert."""

    @property
    def cached_tokens(self) -> int:
        return sum(s.span.num_tokens for s in self.reused)

    @property
    def recomputed_tokens(self) -> int:
        return sum(s.span.num_tokens for s in self.phantoms)

    @property
    def loaded_tokens(self) -> int:
        return sum(s.span.num_tokens for s in self.loads)

    @property
    def phantom_spans(self) -> tuple[Span, ...]:
        return tuple(s.span for s in self.phantoms)


def plan_restore(match: MatchResult, num_tokens: int, min_kept_tokens: int) -> RestorePlan:
    """Restore plan for a prompt of `num_tokens` tokens whose first tokens gave `match`.

    The request must compute at least one token to get logits, so callers match `tokens[:-1]`;
    a match covering all `num_tokens` raises ValueError. Pure: does not touch the tree.
    """
    if match.num_tokens >= num_tokens:
        raise ValueError(f"match covers {match.num_tokens} of {num_tokens} tokens; match tokens[:-1]")
    kept = list(match.segments)
    while kept:
        if kept[-1].tier is None:
            kept.pop()
            continue
        last_hole = max((i for i, s in enumerate(kept) if s.tier is None), default=-1)
        cached_after = sum(s.span.num_tokens for s in kept[last_hole + 1 :])
        if last_hole < 0 or cached_after >= min_kept_tokens:
            break
        del kept[last_hole + 1 :]
    compute_start = kept[-1].span.end if kept else 0
    return RestorePlan(
        num_tokens=num_tokens,
        reused=tuple(s for s in kept if s.tier is Tier.DEVICE),
        phantoms=tuple(s for s in kept if s.tier is None),
        loads=tuple(s for s in kept if s.tier is Tier.HOST),
        compute=Span(compute_start, num_tokens),
        last_node=match.last_node,
    )
