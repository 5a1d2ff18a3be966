"""The engine's KV memory: device and host tensors addressed by the cache core's page handles.

Page `h` of a tier holds slots `[h * page_size, (h + 1) * page_size)` of every layer's K and V, so a
request's page table (one device handle per page of its sequence) maps position `p` to slot
`table[p // page_size] * page_size + p % page_size`. The core decides which pages move between tiers;
`run` performs its ordered `Transfer` list, batching consecutive copies in the same direction (copies
in one direction never depend on each other: only a load and an offload can touch the same page).
On a CPU-only machine both tiers are host memory; the accounting and the copies are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import torch

from backend.cache import CacheConfig, Handle, Tier, Transfer
from backend.engine.config import ModelConfig
from backend.engine.model import KVBuffers


class PagedKVPool:
    def __init__(
        self, model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.page_size = cache.page_size
        self.device = KVBuffers(model, cache.device_pages * cache.page_size, dtype, device)
        host_pages = cache.host_pages + cache.swap_buffer_pages
        self.host = KVBuffers(model, host_pages * cache.page_size, dtype, torch.device("cpu"))
        self._offsets = torch.arange(cache.page_size)

    def slots(self, page_table: Sequence[Handle], start: int, end: int) -> torch.Tensor:
        """Device slots of positions `[start, end)` under `page_table`."""
        positions = torch.arange(start, end)
        pages = torch.tensor(page_table, dtype=torch.int64)[positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def run(self, transfers: Sequence[Transfer]) -> None:
        """Copy pages between tiers in list order."""
        for (src_tier, dst_tier), group in groupby(transfers, key=lambda t: (t.src_tier, t.dst_tier)):
            copies = list(group)
            src = self._page_slots([t.src for t in copies])
            dst = self._page_slots([t.dst for t in copies])
            source, target = self._buffers(src_tier), self._buffers(dst_tier)
            for layer in range(len(source.k)):
                target.k[layer][dst] = source.k[layer][src].to(target.k[layer].device)
                target.v[layer][dst] = source.v[layer][src].to(target.v[layer].device)

    def _page_slots(self, pages: list[Handle]) -> torch.Tensor:
        base = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * self.page_size
        return (base + self._offsets).reshape(-1)

    def _buffers(self, tier: Tier) -> KVBuffers:
        return self.device if tier is Tier.DEVICE else self.host
