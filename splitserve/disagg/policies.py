"""How the PD router chooses an instance within a role: the router's view of each prefill or decode
server (Upstream, with the load it reported in its /metrics), and the routing policies that choose
among the healthy ones. Plain data and arithmetic, no HTTP: the router (entrypoints/router/) keeps the
Upstreams current and asks a Policy for each request."""

from __future__ import annotations

import hashlib
import itertools
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_load", "prefix_aware", "cache_aware")
PREFIX_CHARS = 512  # how much of the prompt prefix_aware hashes
_LOAD_METRICS = {  # by name after the prefix (splitserve:, or vllm: with --metrics-prefix vllm)
    "num_requests_running": "running",
    "num_requests_waiting": "waiting",
    "kv_cache_usage_perc": "kv",
    "kv_transfer_bytes_sent_total": "kv_bytes",  # PD instances: KV moved, both ways (the dashboard's rate)
    "kv_transfer_bytes_received_total": "kv_bytes",
}


# --- instances and their load ------------------------------------------------------------------
@dataclass(frozen=True)
class InstanceLoad:
    """What an instance reported in its /metrics at the last health check."""

    num_requests: float  # running + waiting
    kv_cache_usage: float  # 0..1
    waiting: float = field(default=0.0, compare=False)  # of num_requests, those waiting (the router's ORCA header)
    kv_transfer_bytes: float = field(default=0.0, compare=False)  # KV bytes served plus pulled, since its start

    @property
    def key(self) -> tuple[float, float]:
        return self.num_requests, self.kv_cache_usage


@dataclass(eq=False)
class Upstream:
    """One prefill or decode server, as the router sees it."""

    url: str
    role: str
    healthy: bool = True
    down_reason: str | None = None
    in_flight: int = 0  # requests this router has open on it right now
    load: InstanceLoad | None = None  # its own report, when its /metrics could be read
    # cache_aware: the block hashes its prefix cache holds, from its KV cache events (None: it
    # publishes none), and its block size (entrypoints/router/kv_index.py)
    cached: set[bytes] | None = None
    block_size: int | None = None


def parse_instance_load(text: str) -> InstanceLoad | None:
    """The load of an instance from its Prometheus text (summed over label sets, e.g. several served
    models); None when it does not export the request gauges, so that least_load does not mistake
    "unknown" for "idle"."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = _LOAD_METRICS.get(sample.name.split(":", 1)[-1])
                if key is not None:
                    sums[key] = sums.get(key, 0.0) + sample.value
    except ValueError:
        return None
    if "running" not in sums and "waiting" not in sums:
        return None
    waiting = sums.get("waiting", 0.0)
    return InstanceLoad(sums.get("running", 0.0) + waiting, sums.get("kv", 0.0), waiting, sums.get("kv_bytes", 0.0))


# --- routing policies --------------------------------------------------------------------------
class Policy(ABC):
    """Chooses one instance among the healthy ones of a role (never given an empty list)."""

    name = ""

    @abstractmethod
    def choose(self, instances: Sequence[Upstream], request_body: dict, hashes: list[bytes] | None = None) -> Upstream:
        """`hashes`: the prompt's block hashes (cache_aware only; the others ignore them)."""


class RoundRobinPolicy(Policy):
    """Each instance in turn: even spread when requests are alike, with no state to go stale."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, instances: Sequence[Upstream], request_body: dict, hashes=None) -> Upstream:
        return instances[next(self._counter) % len(instances)]


class LeastLoadPolicy(Policy):
    """The instance with the fewest requests in flight from this router (exact and current); ties go
    to the one reporting the least work of its own (running + waiting, then KV-cache use; it also
    sees other routers' and direct clients' requests, but only as of the last health check), then
    round robin, so that an idle pool is still spread evenly."""

    name = "least_load"

    def __init__(self) -> None:
        self._rr = RoundRobinPolicy()

    def choose(self, instances: Sequence[Upstream], request_body: dict, hashes=None) -> Upstream:
        fewest = min(i.in_flight for i in instances)
        ties = [i for i in instances if i.in_flight == fewest]
        if len(ties) > 1 and all(i.load is not None for i in ties):
            best = min(i.load.key for i in ties)
            ties = [i for i in ties if i.load.key == best]
        return ties[0] if len(ties) == 1 else self._rr.choose(ties, request_body)


def prompt_prefix(request_body: dict) -> str:
    """The first PREFIX_CHARS characters of the prompt (text, or JSON of token ids) or of the JSON
    of the chat messages: requests that share it most likely share prefix-cache blocks."""
    if "prompt" in request_body:
        prompt = request_body["prompt"]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))
    elif "messages" in request_body:
        text = json.dumps(request_body["messages"], separators=(",", ":"))
    else:
        text = ""
    return text[:PREFIX_CHARS]


def _rendezvous_weight(url: str, key: str) -> int:
    """A stable (process-independent, unlike hash()) pseudo-random weight of an (instance, prefix)."""
    digest = hashlib.blake2b(f"{url}\n{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAwarePolicy(Policy):
    """Rendezvous (highest-random-weight) hashing of the prompt prefix: the same prefix always lands
    on the same instance, where its KV blocks are likely cached, and an instance that goes away only
    moves its own share. When the chosen one has more than `skew_factor` times the in-flight
    requests of the least loaded one (counting at least 1 there, so that one open request on an
    idle pool is no skew), the least loaded one takes the request: a hot prefix must not pile up."""

    name = "prefix_aware"

    def __init__(self, skew_factor: float = 2.0) -> None:
        self.skew_factor = skew_factor
        self._least = LeastLoadPolicy()

    def choose(self, instances: Sequence[Upstream], request_body: dict, hashes=None) -> Upstream:
        key = prompt_prefix(request_body)
        chosen = max(instances, key=lambda i: (_rendezvous_weight(i.url, key), i.url))
        fewest = min(i.in_flight for i in instances)
        if chosen.in_flight > self.skew_factor * max(fewest, 1):
            return self._least.choose(instances, request_body)
        return chosen


def cached_prefix_blocks(inst: Upstream, hashes: Sequence[bytes]) -> int:
    """How many of the prompt's leading blocks the instance holds (its KV cache events say)."""
    if inst.cached is None:
        return 0
    count = 0
    for block_hash in hashes:
        if block_hash not in inst.cached:
            break
        count += 1
    return count


class CacheAwarePolicy(Policy):
    """The instance that holds the longest cached prefix of the prompt, exactly (from the instances'
    own KV cache events: entrypoints/router/kv_index.py), least loaded among equals; the least
    loaded instance when none holds any of it, or when the best one has more than `skew_factor`
    times the in-flight requests of the least loaded one (a hot prefix must not pile up)."""

    name = "cache_aware"

    def __init__(self, skew_factor: float = 2.0) -> None:
        self.skew_factor = skew_factor
        self._least = LeastLoadPolicy()

    def choose(self, instances: Sequence[Upstream], request_body: dict, hashes=None) -> Upstream:
        scores = [cached_prefix_blocks(i, hashes) for i in instances] if hashes else [0] * len(instances)
        best = max(scores)
        if best == 0:
            return self._least.choose(instances, request_body)
        chosen = self._least.choose([i for i, s in zip(instances, scores) if s == best], request_body)
        if chosen.in_flight > self.skew_factor * max(min(i.in_flight for i in instances), 1):
            return self._least.choose(instances, request_body)
        return chosen


_POLICY_CLASSES: dict[str, type[Policy]] = {
    p.name: p for p in (RoundRobinPolicy, LeastLoadPolicy, PrefixAwarePolicy, CacheAwarePolicy)
}


def make_policy(name: str) -> Policy:
    return _POLICY_CLASSES[name]()
