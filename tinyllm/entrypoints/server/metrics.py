"""Prometheus metrics for one server, in their own registry (so two apps never share counters)."""

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from tinyllm.engine.engine import EngineStats


class ServerMetrics:
    """Updated by the engine loop thread after every step; prometheus_client is thread-safe."""

    def __init__(self, baseline: EngineStats) -> None:
        """`baseline`: the engine's totals now (it may have run before); counters start there."""
        self.registry = r = CollectorRegistry()
        # process_resident_memory_bytes and the other process_* series, read at each scrape
        # (on Linux): the KV pool's pages count only once written, so this follows the load.
        ProcessCollector(registry=r)
        self.running = Gauge("tinyllm_num_requests_running", "Requests decoding.", registry=r)
        self.waiting = Gauge("tinyllm_num_requests_waiting", "Requests queued.", registry=r)
        self.running_peak = Gauge(
            "tinyllm_num_requests_running_peak",
            "Most requests ever decoding in one step: how far the server batched.",
            registry=r,
        )
        self.kv_usage = Gauge(
            "tinyllm_kv_cache_usage", "Fraction of the KV cache's tokens allocated.", registry=r
        )
        self.kv_blocks = Gauge(
            "tinyllm_kv_blocks_used", "KV cache blocks (slots, in a slot cache) used.", registry=r
        )
        self.preemptions = Counter(
            "tinyllm_preemptions", "Sequences evicted to be recomputed later.", registry=r
        )
        self.prompt_tokens = Counter("tinyllm_prompt_tokens", "Prompt tokens run.", registry=r)
        self.generation_tokens = Counter(
            "tinyllm_generation_tokens", "Tokens generated.", registry=r
        )
        self.prefix_cache_queries = Counter(
            "tinyllm_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache when requests were admitted.",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "tinyllm_prefix_cache_hits",
            "Of the prefix cache's queried tokens, those found cached (not computed).",
            registry=r,
        )
        # vLLM's spec-decode counters; mean acceptance length = 1 + accepted / drafts.
        self.spec_drafts = Counter(
            "tinyllm_spec_decode_num_drafts",
            "Speculative decoding: rows verified with draft tokens.",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "tinyllm_spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "tinyllm_spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
            registry=r,
        )
        self.request_success = Counter(
            "tinyllm_request_success",
            "Requests finished, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "tinyllm_time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80),
            registry=r,
        )
        self.tpot = Histogram(
            "tinyllm_time_per_output_token_seconds",
            "Mean time between a request's generated tokens.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.e2e = Histogram(
            "tinyllm_e2e_request_latency_seconds",
            "From arrival to the last token.",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320),
            registry=r,
        )
        self._last = baseline
        self._peak = 0

    def record_stats(self, s: EngineStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self._peak = max(self._peak, s.num_running)
        self.running_peak.set(self._peak)
        self.kv_usage.set(s.kv_usage)
        self.kv_blocks.set(s.kv_blocks_used)
        # The engine keeps running totals; the counters move by what changed since last time.
        self.preemptions.inc(s.num_preemptions - self._last.num_preemptions)
        self.prompt_tokens.inc(s.prompt_tokens - self._last.prompt_tokens)
        self.generation_tokens.inc(s.generation_tokens - self._last.generation_tokens)
        self.prefix_cache_queries.inc(s.prefix_cache_queries - self._last.prefix_cache_queries)
        self.prefix_cache_hits.inc(s.prefix_cache_hits - self._last.prefix_cache_hits)
        spec, last = s.spec_decode, self._last.spec_decode
        self.spec_drafts.inc(spec.num_drafts - last.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens - last.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens - last.num_accepted_tokens)
        self._last = s

    def record_finished(
        self, finish_reason: str, num_tokens: int, arrival: float, first: float | None, end: float
    ) -> None:
        self.request_success.labels(finish_reason=finish_reason).inc()
        self.e2e.observe(end - arrival)
        if first is not None and num_tokens > 1:
            self.tpot.observe((end - first) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
