"""Prometheus metrics, named as vLLM names them with a `kiln:` prefix, in the app's own registry.

Gauges and token counters are read from the engine when scraped; latencies are observed per request,
as the server sees its outputs arrive: time to first token and end-to-end from when the request was
admitted, inter-token latency between successive outputs that carry new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.kv_offload import OffloadStats
from kiln.runtime.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield self._metric(
            GaugeMetricFamily,
            "kiln:num_requests_running",
            "Sequences running in the engine (in the batch).",
            stats.num_running,
        )
        yield self._metric(
            GaugeMetricFamily,
            "kiln:num_requests_waiting",
            "Sequences waiting to be scheduled.",
            stats.num_waiting,
        )
        yield self._metric(
            GaugeMetricFamily,
            "kiln:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            stats.kv_cache_usage,
        )
        yield self._metric(
            CounterMetricFamily,
            "kiln:prompt_tokens",
            "Prompt tokens of admitted requests.",
            stats.num_prompt_tokens,
        )
        yield self._metric(
            CounterMetricFamily,
            "kiln:prefix_cache_queries",
            "Tokens of admitted sequences looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield self._metric(
            CounterMetricFamily,
            "kiln:prefix_cache_hits",
            "Tokens of admitted sequences found in the prefix cache (an image's tokens only for that image).",
            stats.prefix_cache_hits,
        )
        yield self._metric(
            CounterMetricFamily, "kiln:generation_tokens", "Tokens generated.", stats.num_generation_tokens
        )
        yield self._metric(
            CounterMetricFamily,
            "kiln:num_preemptions",
            "Sequences preempted (to recompute later) for lack of KV blocks.",
            stats.num_preemptions,
        )
        yield self._metric(
            GaugeMetricFamily,
            "kiln:weight_version",
            "The served weights' version (0: the artifact's; +1 each update).",
            self.engine.weight_version.number,
        )
        yield self._metric(
            GaugeMetricFamily,
            "kiln:sleep_level",
            "0 awake; 1 without KV cache; 2 without weights too.",
            self.engine.asleep,
        )
        updates = CounterMetricFamily(
            "kiln:weight_updates",
            "Weight updates, by how they came (disk, distributed) and outcome (ok, failed).",
            labels=["model_name", "source", "outcome"],
        )
        for (how, outcome), count in sorted(stats.weight_updates.items()):
            updates.add_metric([self.model_name, how, outcome], float(count))
        yield updates
        if stats.kv_offload is not None:
            yield from self._kv_offload(stats.kv_offload)
        if self.engine.serves_lora:
            by_adapter = CounterMetricFamily(
                "kiln:lora_requests",
                "Requests admitted, by LoRA adapter (the base model's under the served model's name).",
                labels=["model_name", "lora_name"],
            )
            for adapter, count in sorted(stats.requests_by_adapter.items()):
                by_adapter.add_metric([self.model_name, adapter or self.model_name], float(count))
            yield by_adapter
        speculative = stats.speculative
        if speculative is None:
            return
        for name, doc, value in (
            ("num_drafts", "Speculating sequence-steps.", speculative.num_drafts),
            ("num_draft_tokens", "Draft tokens proposed.", speculative.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted.", speculative.num_accepted_tokens),
        ):
            yield self._metric(CounterMetricFamily, f"kiln:spec_decode_{name}", doc, value)
        per_position = CounterMetricFamily(
            "kiln:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft.",
            labels=["model_name", "position"],
        )
        for position, accepted in enumerate(speculative.accepted_at):
            per_position.add_metric([self.model_name, str(position)], float(accepted))
        yield per_position

    def _kv_offload(self, offload: OffloadStats) -> Iterator[Metric]:
        """Per lower tier (cpu, disk): blocks read back, bytes each way, blocks held, failures by reason
        (foreign, truncated, corrupt: a file not used; write: the tier stopped writing; dropped: blocks
        not saved because the writer was behind)."""
        for name, doc, value_of, family in (
            ("kv_offload_hit_blocks", "KV blocks loaded back from the tier.", "hits", CounterMetricFamily),
            ("kv_offload_read_bytes", "Bytes read from the tier.", "read_bytes", CounterMetricFamily),
            ("kv_offload_written_bytes", "Bytes written to the tier.", "written_bytes", CounterMetricFamily),
            ("kv_offload_stored_blocks", "KV blocks the tier holds.", "stored_blocks", GaugeMetricFamily),
        ):
            metric = family(f"kiln:{name}", doc, labels=["model_name", "tier"])
            for tier, counts in sorted(offload.tiers.items()):
                metric.add_metric([self.model_name, tier], float(getattr(counts, value_of)))
            yield metric
        failures = CounterMetricFamily(
            "kiln:kv_offload_failures",
            "KV offload failures by tier and reason (foreign, truncated, corrupt, write, dropped).",
            labels=["model_name", "tier", "reason"],
        )
        for tier, counts in sorted(offload.tiers.items()):
            for reason in ("foreign", "truncated", "corrupt", "write", "dropped"):
                failures.add_metric([self.model_name, tier, reason], float(counts.failures[reason]))
        yield failures
        yield self._metric(
            GaugeMetricFamily,
            "kiln:kv_offload_writing",
            "1 while the disk tier takes writes; 0 once a write failed (full or read-only folder).",
            0.0 if offload.write_error else 1.0,
        )

    def _metric(
        self, family: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, value: float
    ) -> Metric:
        metric = family(name, doc, labels=["model_name"])
        metric.add_metric([self.model_name], float(value))
        return metric


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "kiln:time_to_first_token_seconds", "Time from admission to the first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "kiln:inter_token_latency_seconds", "Time between a request's successive outputs.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "kiln:e2e_request_latency_seconds", "Time from admission to the last token.", E2E_BUCKETS
        )
        self._success = Counter(
            "kiln:request_success",
            "Requests that ended, by why (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """One engine request's latencies: feed it every output, then `close()` it (aborted if unfinished)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self._last: float | None = None
        self._done = False

    def observe(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        if any(c.delta_token_ids for c in output.outputs):
            if self._last is None:
                self.metrics.time_to_first_token.observe(now - self.arrival)
            else:
                self.metrics.inter_token_latency.observe(now - self._last)
            self._last = now
        if output.finished and not self._done:
            self._done = True
            self.metrics.e2e_request_latency.observe(now - self.arrival)
            self.metrics.request_finished(output.outputs[0].finish_reason or "stop")

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.metrics.request_finished("abort")
