"""The gateway's Prometheus metrics, one registry per gateway (tests build several).

Counters and histograms follow Prometheus conventions (`_total`, `_seconds`, base units). Per-session
gauges (hit rate, append ratio) are exported for the `MAX_SESSION_SERIES` most recent sessions only, so
label cardinality stays bounded however many sessions pass through.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.session_stats import SessionRegistry
from routing.placement import Placement

MAX_SESSION_SERIES = 50
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 600)


class GatewayMetrics:
    def __init__(self, sessions: SessionRegistry, placement: Placement) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "loom_gateway_requests", "Requests by API and status.", ["api", "status"], registry=r
        )
        self.ttft = Histogram(
            "loom_gateway_time_to_first_token_seconds", "Time to the first token.", ["api"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "loom_gateway_request_duration_seconds",
            "Request duration.",
            ["api"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("loom_gateway_prompt_tokens", "Prompt tokens.", ["api"], registry=r)
        self.cached_tokens = Counter(
            "loom_gateway_cached_tokens", "Prompt tokens served from cache.", ["api"], registry=r
        )
        self.generated_tokens = Counter(
            "loom_gateway_generated_tokens", "Generated tokens.", ["api"], registry=r
        )
        r.register(_SessionCollector(sessions, placement))

    def observe(
        self,
        api: str,
        prompt: Sequence[int],
        output: Sequence[int],
        cached: int,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        self.requests.labels(api, "200").inc()
        self.prompt_tokens.labels(api).inc(len(prompt))
        self.cached_tokens.labels(api).inc(cached)
        self.generated_tokens.labels(api).inc(len(output))
        if ttft_s is not None:
            self.ttft.labels(api).observe(ttft_s)
        self.e2e.labels(api).observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SessionCollector(Collector):
    def __init__(self, sessions: SessionRegistry, placement: Placement) -> None:
        self._sessions, self._placement = sessions, placement

    def collect(self) -> Iterable[Metric]:
        hit = GaugeMetricFamily(
            "loom_session_hit_rate", "Cached share of a session's prompt tokens.", labels=["session"]
        )
        ratio = GaugeMetricFamily(
            "loom_session_append_ratio",
            "Share of prompt tokens extending the previous turn.",
            labels=["session"],
        )
        for stats in self._sessions.recent()[:MAX_SESSION_SERIES]:
            hit.add_metric([stats.session], stats.hit_rate)
            if stats.append_ratio is not None:
                ratio.add_metric([stats.session], stats.append_ratio)
        healthy = GaugeMetricFamily(
            "loom_backend_up", "1 if the backend passes health checks.", labels=["backend"]
        )
        for backend, up in self._placement.healthy.items():
            healthy.add_metric([backend], 1.0 if up else 0.0)
        return [hit, ratio, healthy]
