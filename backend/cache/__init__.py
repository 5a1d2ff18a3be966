"""Loom's cache-policy core: a page-granular radix tree with holes, eviction policies (SGLang-style LRU,
its block and head ablations, Penelope), restore plans, two tiers with one deletion order, and the cost
model. Pure Python: imports nothing of ours outside this package and never torch."""

from backend.cache.cache import Admission, CacheFullError, Eviction, InsertResult, SizeInfo, TieredCache
from backend.cache.config import CacheConfig
from backend.cache.policies import POLICIES, EvictionPolicy, Victim
from backend.cache.restore import MatchResult, RestorePlan, Segment
from backend.cache.swap import Transfer
from backend.cache.types import Handle, Span, Tier

__all__ = [
    "POLICIES",
    "Admission",
    "CacheConfig",
    "CacheFullError",
    "Eviction",
    "EvictionPolicy",
    "Handle",
    "InsertResult",
    "MatchResult",
    "RestorePlan",
    "Segment",
    "SizeInfo",
    "Span",
    "Tier",
    "TieredCache",
    "Transfer",
    "Victim",
]
