"""Prometheus metrics, named as vLLM's with the `splitserve:` prefix (`--metrics-prefix vllm`: vLLM's
own names, for its Grafana dashboards and routers) and a model_name label.

With several API workers, prometheus_client's multiprocess mode aggregates them: request-level
counters and histograms are recorded by the worker that served the request (and summed), the
engine's gauges are the most recent value any worker heard from the engine, and the engine's own
cumulative counters (preemptions, prefix-cache queries and hits) are recorded by worker 0 only,
so that they are not counted once per worker.
"""

from __future__ import annotations

import os

from splitserve.engine.messages import KVTransferStats, SchedulerStats, SpecDecodingStats
from splitserve.entrypoints.openai.recent_requests import RecentRequests
from splitserve.kv_tier.stats import KVOffloadStats
from splitserve.outputs import RequestOutput

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


# Prefill/decode KV connector counters (KVTransferStats fields), exported as splitserve:kv_transfer_*_total.
_KV_COUNTERS = {
    "blocks_sent": "KV blocks this prefill instance served to decode instances.",
    "bytes_sent": "KV bytes this prefill instance served.",
    "blocks_received": "KV blocks this decode instance pulled.",
    "bytes_received": "KV bytes this decode instance pulled.",
    "transfer_seconds": "Seconds this decode instance spent pulling KV.",
    "pull_failures": "KV pulls that failed (the request then computed its prompt itself).",
    "pulls_refused": "KV pulls this prefill instance refused (unknown or expired lease).",
    "lease_expiries": "KV leases that expired before a decode instance pulled them.",
}
# Speculative decoding counters (SpecDecodingStats fields), as vLLM's vllm:spec_decode_*.
_SPEC_COUNTERS = {
    "num_drafts": "Request-steps that verified draft tokens.",
    "num_draft_tokens": "Draft tokens verified.",
    "num_accepted_tokens": "Draft tokens accepted.",
}
# KV offloading tier counters (KVOffloadStats fields), exported as splitserve:kv_offload_*_total.
_OFFLOAD_COUNTERS = {
    "stored_blocks": "KV blocks kept in the offloading tier when their device block was reused.",
    "host_hit_blocks": "KV blocks loaded back from the offloading tier's host memory instead of computed.",
    "disk_hit_blocks": "KV blocks loaded back from the disk tier (--kv-cache-dir) instead of computed.",
    "disk_skipped_files": "Disk-tier blocks skipped: corrupt, cut short or written for another layout.",
}


DEFAULT_PREFIX = "splitserve"


class Metrics:
    def __init__(self, model_name: str, client_index: int = 0, prefix: str = DEFAULT_PREFIX):
        from prometheus_client import Counter, Gauge, Histogram

        self.records_engine_counters = client_index == 0
        label = {"model_name": model_name}
        multiproc = os.environ.get(MULTIPROC_ENV) is not None
        gauge_mode = {"multiprocess_mode": "mostrecent"} if multiproc else {}

        def gauge(name, doc):
            return Gauge(f"{prefix}:{name}", doc, ["model_name"], **gauge_mode).labels(**label)

        def counter(name, doc):
            return Counter(f"{prefix}:{name}", doc, ["model_name"]).labels(**label)

        def histogram(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(f"{prefix}:{name}", doc, ["model_name"], buckets=buckets).labels(**label)

        self.num_requests_running = gauge("num_requests_running", "Requests being computed in the engine.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.kv_cache_bytes = gauge("kv_cache_bytes", "Bytes allocated for the KV cache (every rank).")
        self.kv_cache_resident_bytes = gauge(
            "kv_cache_resident_bytes",
            "Bytes of the KV cache backed by memory: on CPU it is mapped lazily and grows as blocks are first used.",
        )
        self.kv_cache_blocks_held = gauge(
            "kv_cache_blocks_held",
            "KV-cache blocks that requests hold, counted by the engine's invariant check while it is idle "
            "(NaN while requests run).",
        )
        self.engine_stats_time = gauge(
            "engine_stats_time_seconds",
            "Unix time at which the engine took the state the gauges above show (old: a stuck engine).",
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = Counter(
            f"{prefix}:request_success", "Finished requests, by finish reason.", ["model_name", "finished_reason"]
        )
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between successive outputs.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.")
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.kv_transfer = {name: counter(f"kv_transfer_{name}", doc) for name, doc in _KV_COUNTERS.items()}
        self.kv_leases_active = gauge("kv_transfer_leases_active", "KV leases waiting for a decode instance's pull.")
        self.spec_decode = {name: counter(f"spec_decode_{name}", doc) for name, doc in _SPEC_COUNTERS.items()}
        self.kv_offload = {name: counter(f"kv_offload_{name}", doc) for name, doc in _OFFLOAD_COUNTERS.items()}
        self.global_scheduler_stolen = counter(
            "global_scheduler_stolen_requests", "Requests this instance took from another's queue (global scheduler)."
        )
        self.global_scheduler_remote = counter(
            "global_scheduler_remote_requests", "Requests of this instance's clients that another instance ran."
        )
        self.spec_decode_per_pos = Counter(
            f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft.",
            ["model_name", "position"],
        )
        self.moe_expert_load = Counter(
            f"{prefix}:moe_expert_load_tokens",
            "MoE models: tokens routed to each expert, summed over the MoE layers (the dashboard's expert load).",
            ["model_name", "expert"],
        )
        self._last: SchedulerStats | None = None
        self._last_kv = KVTransferStats()
        self.recent = RecentRequests()  # GET /recent_requests (the dashboard's table)

    def record_engine_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.kv_cache_bytes.set(stats.kv_cache_bytes)
        self.kv_cache_resident_bytes.set(stats.kv_cache_resident_bytes)
        self.kv_cache_blocks_held.set(float("nan") if stats.kv_blocks_held is None else stats.kv_blocks_held)
        self.engine_stats_time.set(stats.taken_at)
        if not self.records_engine_counters:
            return
        last = self._last
        self._last = stats
        if last is None:
            last = SchedulerStats(0, 0, 0.0, 0, 0, 0)
        self.num_preemptions.inc(max(stats.num_preemptions - last.num_preemptions, 0))
        self.prefix_cache_queries.inc(max(stats.prefix_cache_queries - last.prefix_cache_queries, 0))
        self.prefix_cache_hits.inc(max(stats.prefix_cache_hits - last.prefix_cache_hits, 0))
        if stats.kv_transfer is not None:
            self._record_kv(stats.kv_transfer)
        if stats.spec_decoding is not None:
            self._record_spec_decoding(stats.spec_decoding, last.spec_decoding or SpecDecodingStats())
        if stats.expert_load is not None:
            before = last.expert_load or [0] * len(stats.expert_load)
            for expert, (count, previous) in enumerate(zip(stats.expert_load, before)):
                routed = self.moe_expert_load.labels(model_name=self.model_name, expert=str(expert))
                routed.inc(max(count - previous, 0))
        if stats.kv_offload is not None:
            before = last.kv_offload or KVOffloadStats()
            for name, counter in self.kv_offload.items():
                counter.inc(max(getattr(stats.kv_offload, name) - getattr(before, name), 0))

    def _record_spec_decoding(self, now: SpecDecodingStats, before: SpecDecodingStats) -> None:
        for name, counter in self.spec_decode.items():
            counter.inc(max(getattr(now, name) - getattr(before, name), 0))
        for pos, count in enumerate(now.accepted_per_position):
            previous = before.accepted_per_position[pos] if pos < len(before.accepted_per_position) else 0
            self.spec_decode_per_pos.labels(model_name=self.model_name, position=str(pos)).inc(max(count - previous, 0))

    def _record_kv(self, kv: KVTransferStats) -> None:
        self.kv_leases_active.set(kv.leases_active)
        for name, counter in self.kv_transfer.items():
            counter.inc(max(getattr(kv, name) - getattr(self._last_kv, name), 0))
        self._last_kv = kv

    def record_finished(self, output: RequestOutput, num_generated: int, reasons: list[str]) -> None:
        m = output.metrics
        self.recent.add(output, num_generated, reasons)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(num_generated)
        for reason in reasons:
            self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.decode_time.observe(m.finished_time - m.first_token_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))

    def record_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)


_ENGINE_RESTARTS = None


def engine_restarts_counter(model_name: str, prefix: str = DEFAULT_PREFIX):
    """splitserve:engine_restarts_total: the engine processes this server started again after one died.
    Counted by the process that restarts them (with several workers, their parent)."""
    global _ENGINE_RESTARTS
    from prometheus_client import Counter

    if _ENGINE_RESTARTS is None:
        _ENGINE_RESTARTS = Counter(
            f"{prefix}:engine_restarts", "Engine processes restarted after one died.", ["model_name"]
        )
    return _ENGINE_RESTARTS.labels(model_name=model_name)


def render_metrics() -> tuple[bytes, str]:
    """The exposition text of this process, or of all workers in multiprocess mode."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
