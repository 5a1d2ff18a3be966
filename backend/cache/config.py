"""Configuration of the cache-policy core: one frozen dataclass, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Sizes and policy of a `TieredCache`. Capacities are in tokens and must be whole pages."""

    device_tokens: int
    """KV capacity of the device tier (GPU memory, or the engine's pool on CPU)."""
    page_size: int = 1
    """Tokens per KV page: the unit of allocation, matching and eviction (SGLang: 1; the paper: 64)."""
    host_tokens: int = 0
    """KV capacity of the host tier; 0 disables it (evicted KV becomes a hole at once)."""
    swap_buffer_tokens: int = 1024
    """Reserved host pages through which device<->host swaps run, in chunks, while both tiers are full
    (the paper uses 1,024 tokens). Ignored without a host tier; 0 disables swapping."""
    eviction_policy: str = "penelope"
    """Name of a registered policy: lru, lru-block, leaf-head or penelope."""
    min_kept_tokens: int = 1
    """A hole is recomputed in place (phantom) only when at least this many cached tokens follow it;
    otherwise the request recomputes from the hole on as ordinary prefill."""

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        for name in ("device_tokens", "host_tokens", "swap_buffer_tokens"):
            value = getattr(self, name)
            if value < 0 or value % self.page_size:
                raise ValueError(
                    f"{name} must be a non-negative multiple of page_size {self.page_size}, got {value}"
                )
        if self.device_tokens == 0:
            raise ValueError("device_tokens must be at least one page")
        if self.min_kept_tokens < 1:
            raise ValueError(f"min_kept_tokens must be at least 1, got {self.min_kept_tokens}")

    @property
    def device_pages(self) -> int:
        return self.device_tokens // self.page_size

    @property
    def host_pages(self) -> int:
        return self.host_tokens // self.page_size

    @property
    def swap_buffer_pages(self) -> int:
        return self.swap_buffer_tokens // self.page_size if self.host_tokens else 0
