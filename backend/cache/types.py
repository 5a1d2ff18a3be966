"""Small value types shared by the cache-policy core: tiers, token spans and KV handles.

A *handle* is an opaque int naming one page of KV in one tier: a device page index for `Tier.DEVICE`, a
host page index for `Tier.HOST`. The core never interprets it; adapters (engine, SGLang plugin) map it to
memory. Spans are half-open token ranges `[start, end)` at the tokens' absolute positions in a sequence.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, NewType

Handle = NewType("Handle", int)


class Tier(enum.Enum):
    """Where a page's KV lives. A node with no tier is a hole: tokens kept, KV gone."""

    DEVICE = "device"
    HOST = "host"


class Span(NamedTuple):
    """Half-open token range `[start, end)` at absolute positions."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start
