"""GET /v1/loads: the instance's load as SGLang reports it (sglang/srt/entrypoints/v1_loads.py), for
routers and gateways that poll it: one entry per data-parallel replica (`dp_rank`) under `loads`,
and their `aggregate`.

Each entry has SGLang's core fields, from the engine's last stats:

- `num_running_reqs`, `num_waiting_reqs`, `num_total_reqs` (their sum): the engine's queues, the
  same numbers as the num_requests_running / num_requests_waiting gauges of /metrics;
- `token_usage`: the fraction of KV-cache blocks in use (kv_cache_usage_perc); `num_used_tokens`:
  the tokens those blocks hold room for (token_usage x max_total_num_tokens), and
  `max_total_num_tokens`: the KV cache's capacity in tokens (num_gpu_blocks x block_size);
- `gen_throughput`: tokens sampled per second over the last few seconds;
- `cache_hit_rate`: prompt tokens found in the prefix cache over those looked up, since start
  (prefix_cache_hits / prefix_cache_queries of /metrics);
- `max_running_requests` (--max-num-seqs) and `utilization`, SGLang's
  max(running / max_running_requests, token_usage / 0.9), -1 on a PD prefill instance as in SGLang;

and, as `include` asks (SGLang's section names; default all): `speculative` (with speculative
decoding: `accept_length`, tokens per verified step, and `accept_rate`), `lora` (with LoRA:
`slots_used` of `slots_total` (--max-loras) and their ratio `utilization`, plus splitserve's
`running_lora_adapters` and `waiting_lora_adapters`, requests by adapter name) and `disaggregation`
(`mode`: prefill, decode or null; on a prefill instance `prefill_inflight_queue_reqs`, the KV
leases waiting for a decode instance; on a decode instance `kv_transfer_speed_gb_s`, bytes pulled
over the time spent pulling since start). SGLang's `memory` and `queues` sections, and
`num_total_tokens`, are not reported: splitserve does not know those figures.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import datetime, timezone

from splitserve.config import EngineConfig
from splitserve.engine.messages import SchedulerStats
from splitserve.entrypoints.http import APIError
from splitserve.version import __version__

SECTIONS = ("core", "spec", "lora", "disagg")  # SGLang's include names that splitserve fills ("all": every one)
_OTHER_SGLANG_SECTIONS = ("memory", "queues")  # accepted, and empty
_RATE_WINDOW_S = 5.0  # gen_throughput's window
_SAMPLE_EVERY_S = 0.5


class DecodeRates:
    """Each replica's tokens sampled per second over the last few seconds, from the cumulative
    `generation_tokens` its stats carry (sampled at most every half second)."""

    def __init__(self) -> None:
        self._samples: list[deque[tuple[float, int]]] = []
        self._last = float("-inf")

    def observe(self, parts: list[SchedulerStats | None]) -> None:
        now = time.monotonic()
        if now - self._last < _SAMPLE_EVERY_S:
            return
        self._last = now
        while len(self._samples) < len(parts):
            self._samples.append(deque())
        for samples, stats in zip(self._samples, parts):
            if stats is None or (samples and stats.taken_at <= samples[-1][0]):
                continue
            samples.append((stats.taken_at, stats.generation_tokens))
            while len(samples) > 2 and samples[-1][0] - samples[1][0] >= _RATE_WINDOW_S:
                samples.popleft()

    def rate(self, index: int) -> float:
        samples = self._samples[index] if index < len(self._samples) else ()
        if len(samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = samples[0], samples[-1]
        return max(n1 - n0, 0) / (t1 - t0) if t1 > t0 else 0.0


def parse_include(include: str | None) -> set[str]:
    """SGLang's `include` query parameter (comma-separated section names) as a set of SECTIONS."""
    if not include:
        return set(SECTIONS)
    names = {name.strip() for name in include.split(",") if name.strip()}
    unknown = names - {*SECTIONS, *_OTHER_SGLANG_SECTIONS, "all"}
    if unknown:
        valid = sorted({*SECTIONS, *_OTHER_SGLANG_SECTIONS, "all"})
        raise APIError(f"Invalid include sections: {sorted(unknown)}. Valid options: {valid}", param="include")
    return set(SECTIONS) if "all" in names else names | {"core"}


def replica_load(
    stats: SchedulerStats | None, dp_rank: int, config: EngineConfig, pd_role: str, rate: float, include: set[str]
) -> dict:
    """One replica's entry of /v1/loads (zeros before the engine's first stats)."""
    stats = stats or SchedulerStats(0, 0, 0.0, 0, 0, 0)
    cc, max_running = config.cache_config, config.scheduler_config.max_num_seqs
    capacity = (cc.num_gpu_blocks or 0) * cc.block_size
    usage = stats.kv_cache_usage
    load = {
        "dp_rank": dp_rank,
        "num_running_reqs": stats.num_running,
        "num_waiting_reqs": stats.num_waiting,
        "num_used_tokens": round(usage * capacity),
        "max_total_num_tokens": capacity,
        "token_usage": round(usage, 4),
        "gen_throughput": round(rate, 2),
        "cache_hit_rate": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 4)
        if stats.prefix_cache_queries
        else 0.0,
        "utilization": -1 if pd_role == "prefill" else round(max(stats.num_running / max_running, usage / 0.9), 4),
        "max_running_requests": max_running,
    }
    spec = stats.spec_decoding
    if "spec" in include and spec is not None and spec.num_drafts:
        load["speculative"] = {
            "accept_length": round(1 + spec.num_accepted_tokens / spec.num_drafts, 4),
            "accept_rate": round(spec.num_accepted_tokens / max(spec.num_draft_tokens, 1), 4),
        }
    if "lora" in include and config.lora_config is not None:
        running = stats.running_loras or {}
        slots = config.lora_config.max_loras
        load["lora"] = {
            "slots_used": len(running),
            "slots_total": slots,
            "utilization": round(len(running) / slots, 4),
            "running_lora_adapters": running,
            "waiting_lora_adapters": stats.waiting_loras or {},
        }
    if "disagg" in include:
        load["disaggregation"] = _disaggregation(stats, pd_role)
    load["num_total_reqs"] = stats.num_running + stats.num_waiting
    return load


def _disaggregation(stats: SchedulerStats, pd_role: str) -> dict:
    section: dict = {"mode": pd_role if pd_role in ("prefill", "decode") else "null"}
    kv = stats.kv_transfer
    if kv is not None and pd_role == "prefill":
        section["prefill_inflight_queue_reqs"] = kv.leases_active
    if kv is not None and pd_role == "decode":
        speed = kv.bytes_received / kv.transfer_seconds / 1e9 if kv.transfer_seconds > 0 else 0.0
        section["kv_transfer_speed_gb_s"] = round(speed, 4)
    return section


def aggregate(loads: list[dict]) -> dict:
    """SGLang's `aggregate` of several entries (replicas, or a router's instances)."""
    n = len(loads)
    if not n:
        return {
            "total_running_reqs": 0,
            "total_waiting_reqs": 0,
            "total_reqs": 0,
            "total_used_tokens": 0,
            "avg_token_usage": 0.0,
            "avg_throughput": 0.0,
            "avg_utilization": 0.0,
        }
    return {
        "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
        "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
        "total_reqs": sum(d["num_running_reqs"] + d["num_waiting_reqs"] for d in loads),
        "total_used_tokens": sum(d["num_used_tokens"] for d in loads),
        "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
        "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2),
        "avg_utilization": round(sum(d["utilization"] for d in loads) / n, 4),
    }


def loads_answer(loads: list[dict]) -> dict:
    """The body of GET /v1/loads around its entries."""
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": __version__,
        "dp_rank_count": len(loads),
        "loads": loads,
        "aggregate": aggregate(loads),
    }


def check_dp_rank(dp_rank: str | None, replicas: int) -> int | None:
    """SGLang's `dp_rank` query parameter: one replica's entry only."""
    if dp_rank is None:
        return None
    if not dp_rank.isdigit() or int(dp_rank) >= replicas:
        raise APIError(f"dp_rank must be an integer from 0 to {replicas - 1}, got {dp_rank!r}.", param="dp_rank")
    return int(dp_rank)
