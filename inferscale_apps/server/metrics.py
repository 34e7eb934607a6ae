"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "inferscale_requests", "HTTP requests by route and status", ["method", "route", "status"], registry=r
        )
        self.in_flight = Gauge("inferscale_generations_in_flight", "Generations running now", registry=r)
        self.ttft = Histogram(
            "inferscale_ttft_seconds", "Time to first token of generations", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "inferscale_generation_seconds", "Whole generation time", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("inferscale_prompt_tokens", "Prompt tokens served", registry=r)
        self.completion_tokens = Counter("inferscale_completion_tokens", "Tokens generated", registry=r)
        self.injected_tokens = Counter(
            "inferscale_injected_tokens", "Prompt tokens whose KV was injected instead of prefilled", registry=r
        )
        self.cached_tokens = Counter("inferscale_cached_tokens", "Prompt tokens found in vLLM's prefix cache", registry=r)
        self.errors = Counter("inferscale_errors", "Error responses by error code", ["code"], registry=r)
        #: Read at each scrape: the store counts what it refused, the server only reports it.
        self.store_stats: Callable[[], dict[str, int]] = dict
        r.register(_StoreCollector(self))

    def observe_generation(self, endpoint: str, result: object) -> None:
        usage = result.usage  # type: ignore[attr-defined]
        self.ttft.labels(endpoint).observe(result.ttft_s)  # type: ignore[attr-defined]
        self.latency.labels(endpoint).observe(result.latency_s)  # type: ignore[attr-defined]
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        self.injected_tokens.inc(usage.injected_tokens)
        self.cached_tokens.inc(usage.cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily]:
        try:
            stats = self.metrics.store_stats()
        except Exception:  # noqa: BLE001  (a closed or unusable store: report nothing, not a 500)
            stats = {}
        yield CounterMetricFamily(
            "inferscale_kv_corrupt", "KV files refused on load (checksum mismatch or non-finite values) and re-encoded",
            value=stats.get("disk_corrupt", 0),
        )
