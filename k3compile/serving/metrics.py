"""The server's Prometheus metrics (`GET /metrics`; docs/architecture.md, "Serving"), in a registry of their own (two
servers in one process count apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no `_created` series beside each counter (process-wide; k3compile's are all here)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("k3_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("k3_prompt_tokens", "Prompt tokens of the requests admitted", registry=r)
        self.generated = Counter("k3_generated_tokens", "Tokens generated", registry=r)
        self.finishes = Counter("k3_finished_requests", "Generations ended, by reason", ["reason"], registry=r)
        self.queue_depth = Gauge("k3_queue_depth", "Requests waiting for a batch row", registry=r)
        self.running = Gauge("k3_running_requests", "Requests in the running batch or its prefill", registry=r)
        self.ttft = Histogram("k3_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("k3_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.cache_lookups = Counter("k3_prefix_cache_lookups", "Prefix cache lookups", registry=r)
        self.cache_hits = Counter("k3_prefix_cache_hits", "Prefix cache lookups that found a prefix", registry=r)
        self.cache_hit_tokens = Counter("k3_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                        registry=r)
        self.cache_bytes = Gauge("k3_prefix_cache_bytes", "Bytes the prefix cache holds", registry=r)

    # the engine's hooks (its thread)
    def queue(self, depth: int) -> None:
        self.queue_depth.set(depth)

    def prefix(self, enabled: bool, tokens: int) -> None:
        if enabled:
            self.cache_lookups.inc()
            if tokens:
                self.cache_hits.inc()
                self.cache_hit_tokens.inc(tokens)

    def token(self, request, now: float) -> None:
        self.generated.inc()
        if request.first_token_at is None:
            self.ttft.observe(now - request.submitted)
            self.prompt_tokens.inc(len(request.prompt))
        else:
            self.itl.observe(now - request.last_token_at)

    def finished(self, reason: str) -> None:
        self.finishes.labels(reason).inc()

    def render(self, engine) -> bytes:
        self.queue_depth.set(engine.queue_depth)
        self.running.set(engine.running)
        if engine.cache is not None:
            self.cache_bytes.set(engine.cache.bytes)
        return generate_latest(self.registry)
