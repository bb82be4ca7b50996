"""/metrics: Prometheus text from the HTTP actor's own timings and the pipeline's figures.

Measured here, per HTTP request: time to first token, inter-token latency and end-to-end
latency (histograms), requests by endpoint and status, prompt and generated tokens billed.
Read from the actors at scrape time (decode ``stats()``, router ``stats()``, loader health):
requests running / waiting, KV cache usage, engine token totals, and what no peer exports:
expert hit rate, lookups and bytes per token per tier (device, ram, nvme), miss stall seconds,
prefetch precision / recall, loaders alive; for a model with a PLE tier (qwen4_exp stores), PLE
rows looked up and read, bytes read, rows and bytes per token, row-cache hit rate.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIERS = ("device", "ram", "nvme")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)


class _PipelineCollector:
    """Turns the last snapshot of the actors' figures into metric families."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterable[Metric]:
        s = self.snapshot
        up = GaugeMetricFamily("moestream_pipeline_up", "1 when the decode actor answered the "
                               "last scrape, else 0 (the figures below are then absent)")
        dec = s.get("decode")
        up.add_metric([], 1.0 if dec else 0.0)
        yield up
        router = s.get("router") or {}
        if router:
            c = CounterMetricFamily("moestream_router_rejected", "Requests the router refused "
                                    "because its queue was full (HTTP 429)")
            c.add_metric([], router.get("busy", 0))
            yield c
        loaders = s.get("loaders")
        if loaders is not None:
            g = GaugeMetricFamily("moestream_loaders_alive", "Expert-loader actors that answered "
                                  "a health check")
            g.add_metric([], sum(1 for ok in loaders.values() if ok))
            yield g
            g = GaugeMetricFamily("moestream_loaders", "Expert-loader actors the decode actor "
                                  "routes fetches to")
            g.add_metric([], len(loaders))
            yield g
        if not dec:
            return
        running = dec.get("running", 0)
        yield _gauge("moestream_requests_running", "Sequences in the decode engine's batch", running)
        in_router = len(router.get("active", [])) if router else 0
        waiting = max(dec.get("waiting", 0), in_router - running)
        yield _gauge("moestream_requests_waiting", "Requests admitted and not yet running "
                     "(router queue and engine waiting list)", waiting)
        used, total = dec.get("kv_blocks_used", 0), dec.get("kv_blocks_total", 0)
        yield _gauge("moestream_kv_cache_usage_ratio", "Fraction of paged KV blocks in use",
                     used / total if total else 0.0)
        yield _gauge("moestream_kv_blocks_used", "Paged KV blocks in use", used)
        yield _gauge("moestream_kv_blocks_total", "Paged KV blocks in the pool", total)
        eng = dec.get("engine") or {}
        for key, help_ in (("prompt_tokens", "Prompt tokens of requests the engine admitted"),
                           ("generated_tokens", "Tokens the engine generated"),
                           ("computed_tokens", "Tokens fed through the model, recomputation "
                            "included"),
                           ("preemptions", "Sequences preempted (KV blocks ran out)"),
                           ("prefix_query_tokens", "Tokens of admitted sequences looked up in "
                            "the prefix cache"),
                           ("prefix_hit_tokens", "Of those, tokens reused from cached KV blocks "
                            "(not computed)")):
            if key in eng:
                c = CounterMetricFamily(f"moestream_engine_{key}", help_)
                c.add_metric([], eng[key])
                yield c
        if "prefix_query_tokens" in eng:
            q = eng["prefix_query_tokens"]
            yield _gauge("moestream_prefix_cache_hit_rate", "Share of admitted tokens the prefix "
                         "cache held (prefix_hit_tokens / prefix_query_tokens)",
                         eng["prefix_hit_tokens"] / q if q else 0.0)
        cache = dec.get("cache") or {}
        if cache:
            yield from _cache_families(cache)


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, help_)
    g.add_metric([], float(value))
    return g


def _cache_families(c: dict[str, Any]) -> Iterable[Metric]:
    lookups = CounterMetricFamily("moestream_expert_lookups", "Expert lookups per tier and "
                                  "result (a device miss goes to ram, a ram miss to nvme)",
                                  labels=["tier", "result"])
    hit_rate = GaugeMetricFamily("moestream_expert_hit_rate", "Share of the tier's expert "
                                 "lookups it served itself", labels=["tier"])
    per_tok = GaugeMetricFamily("moestream_expert_bytes_per_token", "Expert bytes that entered "
                                "the tier per generated token", labels=["tier"])
    for tier in TIERS:
        hits, misses = c.get(f"{tier}_hits"), c.get(f"{tier}_misses")
        if hits is None or misses is None:
            continue
        lookups.add_metric([tier, "hit"], hits)
        lookups.add_metric([tier, "miss"], misses)
        hit_rate.add_metric([tier], hits / (hits + misses) if hits + misses else 0.0)
        key = "bytes_to_device_per_token" if tier == "device" else f"{tier}_bytes_per_token"
        if key in c:
            per_tok.add_metric([tier], float(c[key]))
    yield lookups
    yield hit_rate
    yield per_tok
    stall = CounterMetricFamily("moestream_expert_miss_stall_seconds", "Seconds the compute "
                                "waited for experts that missed the device cache")
    stall.add_metric([], float(c.get("stall_s", 0.0)))
    yield stall
    yield _gauge("moestream_prefetch_precision", "Prefetched experts that were then used, over "
                 "all prefetched", c.get("prefetch_precision", 0.0))
    yield _gauge("moestream_prefetch_recall", "Used experts that had been prefetched, over all "
                 "used", c.get("prefetch_recall", 0.0))
    issued = CounterMetricFamily("moestream_prefetch_issued", "Expert prefetches issued")
    issued.add_metric([], c.get("prefetch_issued", 0))
    yield issued
    if "ple_lookups" in c:  # a model reading its PLE n-gram tables from the store (engine.store.ple_disk)
        yield from _ple_families(c)


def _ple_families(c: dict[str, Any]) -> Iterable[Metric]:
    for key, name, help_ in (
            ("ple_lookups", "moestream_ple_row_lookups", "PLE n-gram table rows the model gathered"),
            ("ple_rows_read", "moestream_ple_rows_read", "PLE rows read from the store's row files"),
            ("ple_bytes_read", "moestream_ple_read_bytes", "Bytes read from PLE row files (whole 4 KiB pages)")):
        m = CounterMetricFamily(name, help_)
        m.add_metric([], c[key])
        yield m
    yield _gauge("moestream_ple_row_cache_hit_rate", "Share of PLE row lookups served by the RAM row cache",
                 c["ple_hit_rate"])
    yield _gauge("moestream_ple_rows_per_token", "PLE rows gathered per generated token", c["ple_rows_per_token"])
    yield _gauge("moestream_ple_bytes_per_token", "PLE row-file bytes read per generated token",
                 c["ple_bytes_per_token"])


class Metrics:
    """The registry /metrics renders; one per HTTP actor."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moestream_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("moestream_http_requests_in_flight", "HTTP generation requests "
                               "being answered", registry=r)
        self.prompt_tokens = Counter("moestream_prompt_tokens", "Prompt tokens of finished HTTP "
                                     "requests", registry=r)
        self.generation_tokens = Counter("moestream_generation_tokens", "Generated tokens sent to "
                                         "HTTP clients", registry=r)
        self.ttft = Histogram("moestream_time_to_first_token_seconds", "Request arrival to the "
                              "first token sent (streaming requests)", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("moestream_inter_token_latency_seconds", "Gap between consecutive "
                             "tokens of a streamed response (a chunk of k tokens counts k-1 zero "
                             "gaps)", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("moestream_e2e_request_latency_seconds", "Request arrival to its last "
                             "byte", buckets=_TTFT_BUCKETS, registry=r)
        self.aborted = Counter("moestream_http_aborted", "Requests whose client went away before "
                               "the end (aborted in the engine)", registry=r)
        self.pipeline = _PipelineCollector()
        r.register(self.pipeline)

    def render(self, snapshot: dict[str, Any]) -> bytes:
        self.pipeline.snapshot = snapshot
        return generate_latest(self.registry)
