"""Prometheus metrics of one server, in its own CollectorRegistry (never the process-global one: two apps in
one process, as in the tests, must not share or clash).

Request-level series are updated by the serving code as requests move; engine-level gauges (queue length,
cache usage, prefix-cache hits, free blocks, speculative decoding counters) are read from the engine's stats at
scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "deepinfer"
# Latency buckets from ~1 ms (tiny CPU models) to minutes (long generations on big ones).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0, 640.0)
_TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                          1.0, 2.5, 5.0, 10.0)
KNOWN_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})


class _EngineStatsCollector(Collector):
    """Gauges and counters read from `stats()` (an EngineStats) at each scrape."""

    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        if s is None:
            return
        gauges = {
            "num_requests_running": ("Sequences the engine is running", s.running),
            "num_requests_waiting": ("Sequences waiting in the engine's queue", s.waiting),
            "kv_cache_usage_ratio": ("Fraction of KV-cache blocks in use", s.cache_usage),
            "prefix_cache_hit_rate": ("Prefix-cache hit rate (cached blocks / queried blocks)", s.prefix_cache_hit_rate),
            "cache_blocks_total": ("KV-cache blocks", s.num_blocks),
            "cache_blocks_free": ("KV-cache blocks not held by any request", s.free_blocks),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        counters = {
            "num_preemptions": ("Sequences preempted for lack of cache blocks", s.preemptions),
            "prompt_tokens": ("Prompt tokens the engine has admitted", s.prompt_tokens),
            "generation_tokens": ("Tokens the engine has generated", s.generated_tokens),
            "prefix_cache_queries": ("Blocks looked up in the prefix cache", getattr(s, "prefix_cache_queries", None)),
            "prefix_cache_hits": ("Blocks found in the prefix cache", getattr(s, "prefix_cache_hits", None)),
        }
        for name, (doc, value) in counters.items():
            if value is not None:
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        spec = getattr(s, "spec_decode", None)
        if spec is not None:  # vLLM's spec_decode_* series
            for name, doc, value in (
                ("spec_decode_num_drafts", "Speculative rounds (sequence-steps that drafted)", spec.num_drafts),
                ("spec_decode_num_proposed_tokens", "Draft tokens the drafter proposed", spec.num_proposed_tokens),
                ("spec_decode_num_draft_tokens", "Draft tokens the target verified", spec.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens),
                ("spec_decode_draft_seconds", "Wall time spent drafting (the drafter's passes and draws)",
                 spec.draft_seconds),
            ):
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
            per_pos = CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by draft position", labels=["position"])
            for k, value in enumerate(spec.accepted_per_position):
                per_pos.add_metric([str(k)], float(value))
            yield per_pos
            yield GaugeMetricFamily(f"{PREFIX}_spec_decode_mean_accepted_length",
                                    "Tokens per speculative round, the target's own token included",
                                    value=spec.mean_accepted_length)
            yield GaugeMetricFamily(f"{PREFIX}_spec_decode_verification_waste",
                                    "Rejected / verified draft tokens", value=spec.verification_waste)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], Any] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter(f"{PREFIX}_request_finished", "Generation requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter(f"{PREFIX}_request_rejected", "Requests refused before reaching the engine",
                                ["reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between consecutive generated tokens",
                             buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Counter(f"{PREFIX}_request_prompt_tokens", "Prompt tokens of served requests",
                                             registry=r)
        self.request_generation_tokens = Counter(f"{PREFIX}_request_generation_tokens",
                                                 "Tokens generated for served requests", registry=r)
        self.active = Gauge(f"{PREFIX}_server_active_requests", "Engine requests the server has admitted and not finished",
                            registry=r)
        if engine_stats is not None:
            r.register(_EngineStatsCollector(engine_stats))

    def count_response(self, path: str, status: int) -> None:
        endpoint = path if path in KNOWN_ENDPOINTS else "other"  # bounded label values
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
