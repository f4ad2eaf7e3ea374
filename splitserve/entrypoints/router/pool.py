"""The PD router's instances: both roles' Upstreams, their health checks, the policy that picks one for a
request, and one HTTP exchange with an instance over the router's shared session."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

import aiohttp
from fastapi import Request

from splitserve.disagg.policies import InstanceLoad, Policy, Upstream, make_policy, parse_instance_load
from splitserve.entrypoints.router.config import DECODE, MIXED, PREFILL, ROLES, RouterConfig
from splitserve.entrypoints.router.kv_index import KVEventIndex, prompt_block_hashes
from splitserve.entrypoints.router.metrics import RouterMetrics
from splitserve.entrypoints.router.relay import (
    UPSTREAM_ERRORS,
    OpenRequest,
    describe_error,
    status_reason,
    until_disconnected,
)
from splitserve.tracing import tracing_for

logger = logging.getLogger("splitserve.router")
PD_ROLE_CHANGED = "pd_role_changed"  # the type of an instance's 409 (entrypoints/openai/serving_pd.py)
ROLE_RULE = "Rule NODE_PORTS order"  # how the refusal of an instance in the wrong role is named


class UpstreamPool:
    """The instances, their health and the policies; the request flow is the Router's, on top of it."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.instances: dict[str, list[Upstream]] = {
            PREFILL: [Upstream(u, PREFILL) for u in config.prefill_urls],
            DECODE: [Upstream(u, DECODE) for u in config.decode_urls],
            MIXED: [Upstream(u, MIXED) for u in config.mixed_urls],
        }
        # Where a request's answer comes from: the decode instances, or the replicas.
        self.answer_role = MIXED if config.mixed_urls else DECODE
        self.policies: dict[str, Policy] = {role: make_policy(config.policy) for role in ROLES}
        self.metrics = RouterMetrics()
        for inst in self.all_instances():
            self.metrics.instance_healthy.labels(instance=inst.url, role=inst.role).set(1)
        self.session: aiohttp.ClientSession | None = None
        self.tracing = tracing_for(config.otlp_traces_endpoint, "splitserve-router")
        self.kv_index = KVEventIndex() if config.policy == "cache_aware" else None
        self.local_tokenizer = None  # the router's own (--tokenizer): no /tokenize call per request
        if self.kv_index is not None and config.tokenizer is not None:
            from splitserve.entrypoints.router.local_tokenizer import RouterTokenizer

            self.local_tokenizer = RouterTokenizer(config.tokenizer)
        self._health_task: asyncio.Task | None = None

    def all_instances(self) -> list[Upstream]:
        return [inst for role in ROLES for inst in self.instances[role]]

    def describe_instances(self) -> dict:
        """The instances as the dashboard shows them (GET /router/instances): role, health, why down,
        this router's open requests on each, and the load each reported at its last health check (with
        the KV bytes it has moved, of which the dashboard shows the rate)."""
        rows = []
        for inst in self.all_instances():
            load = inst.load
            rows.append(
                {
                    "url": inst.url,
                    "role": inst.role,
                    "healthy": inst.healthy,
                    "down_reason": inst.down_reason,
                    "in_flight": inst.in_flight,
                    "num_requests": None if load is None else load.num_requests,
                    "kv_cache_usage": None if load is None else load.kv_cache_usage,
                    "kv_transfer_bytes": None if load is None else load.kv_transfer_bytes,
                }
            )
        return {"policy": self.config.policy, "roles": list(self.config.serving_roles), "instances": rows}

    def healthy(self, role: str) -> list[Upstream]:
        return [i for i in self.instances[role] if i.healthy]

    def role_pool(self, role: str) -> list[Upstream]:
        """The instances that take `role`'s work: in a PD pool an instance switched to mixed takes both
        phases (engine/pd_role.py)."""
        if role in (PREFILL, DECODE) and self.answer_role == DECODE:
            return self.instances[role] + self.instances[MIXED]
        return self.instances[role]

    def pick(
        self, role: str, request_body: dict, exclude: Sequence[Upstream] = (), hashes: list[bytes] | None = None
    ) -> Upstream | None:
        """The policy's choice among the up instances not tried yet for this request. With no decode
        instance up, the down ones are tried anyway: a health mark is a hint (a busy instance can miss
        a check), and a failed attempt costs less than refusing the request; prefill has its fallback."""
        candidates = [i for i in self.role_pool(role) if i.healthy and i not in exclude]
        if not candidates and role == self.answer_role:  # never one in the wrong role: it would not decode
            candidates = [
                i for i in self.instances[role] if i not in exclude and ROLE_RULE not in (i.down_reason or "")
            ]
        return self.policies[role].choose(candidates, request_body, hashes) if candidates else None

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """One shared session (connection reuse to every instance; no limit on connections, since
        each open stream holds one), a first health check so that the router starts with the real
        state, then the periodic checks."""
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout, sock_connect=self.config.connect_timeout)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60), timeout=timeout
        )
        await self.check_all()
        wrong = [i for i in self.all_instances() if i.down_reason and ROLE_RULE in i.down_reason]
        if wrong:
            await self.session.close()
            raise RuntimeError("; ".join(f"{i.url} {i.down_reason}" for i in wrong))
        for role in self.config.serving_roles:
            logger.info(
                "Router: %d of %d %s instance(s) up: %s",
                len(self.healthy(role)),
                len(self.instances[role]),
                role,
                ", ".join(i.url for i in self.healthy(role)) or "none",
            )
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        if self.kv_index is not None:
            await self.kv_index.stop()

    # --- health ------------------------------------------------------------------------------
    def _headers(
        self, request_id: str | None = None, content_type: str | None = None, extra: dict[str, str] | None = None
    ) -> dict[str, str]:
        headers = dict(extra or {})
        if self.config.instance_api_key:
            headers["Authorization"] = f"Bearer {self.config.instance_api_key}"
        if request_id:
            headers["X-Request-Id"] = request_id
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def mark_down(self, inst: Upstream, reason: str) -> None:
        inst.down_reason = reason
        self.metrics.instance_healthy.labels(instance=inst.url, role=inst.role).set(0)
        if inst.healthy:
            inst.healthy = False
            logger.warning("%s instance %s is down: %s", inst.role, inst.url, reason)

    def mark_up(self, inst: Upstream) -> None:
        inst.down_reason = None
        self.metrics.instance_healthy.labels(instance=inst.url, role=inst.role).set(1)
        if not inst.healthy:
            inst.healthy = True
            logger.info("%s instance %s is up again", inst.role, inst.url)

    def _failed(self, inst: Upstream, reason: str) -> None:
        """A request failed on `inst`: count it, and send nothing more there until a health check passes."""
        self.metrics.failures.labels(role=inst.role).inc()
        self.mark_down(inst, reason)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check_instance(i) for i in self.all_instances()))

    async def check_instance(self, inst: Upstream) -> None:
        """GET /health (up: a 200 in time), then /metrics for the instance's load."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        try:
            async with self.session.get(inst.url + "/health", headers=self._headers(), timeout=timeout) as resp:
                data = await resp.read()
                status = resp.status
        except UPSTREAM_ERRORS as exc:
            self.mark_down(inst, describe_error(exc, self.config.health_timeout))
            return
        if status != 200:
            self.mark_down(inst, "/health " + status_reason(status, data))
            return
        info = await self._fetch_role(inst, timeout)
        role = info.get("pd_role") if info is not None else None
        if role is not None and role != inst.role and info.get("epoch"):  # it switched while serving
            self.follow_role(inst, role, info["epoch"])
        elif role is not None and role != inst.role:
            self.mark_down(
                inst,
                f"answers as a {role} instance but is listed among the {inst.role} instances. {ROLE_RULE}: the "
                "prefill instances' ports first, then the decode instances', in the global rank table's order "
                "(with --prefill/--decode/--mixed, each URL under its own role)",
            )
            return
        self.mark_up(inst)
        if self.kv_index is not None and info is not None:
            self.kv_index.watch(inst, info)
        inst.load = await self._fetch_load(inst, timeout)

    def follow_role(self, inst: Upstream, role: str, epoch: int) -> None:
        """An instance that took another PD role (POST /pd_role) is listed under its new role: the
        next requests of that role may go to it, none of its old role does."""
        if role not in self.instances:
            self.mark_down(inst, f"answers with an unknown PD role {role!r}")
            return
        previous = inst.role
        self.instances[previous].remove(inst)
        self.metrics.instance_healthy.remove(inst.url, previous)
        inst.role = role
        self.instances[role].append(inst)
        self.metrics.instance_healthy.labels(instance=inst.url, role=role).set(int(inst.healthy))
        served = "prefill and decode work" if role == MIXED and self.answer_role == DECODE else f"{role} work"
        logger.info("%s switched from %s to %s (PD role epoch %d): it gets %s", inst.url, previous, role, epoch, served)

    async def role_changed(self, inst: Upstream, status: int, data: bytes) -> bool:
        """A 409 saying the instance switched its PD role since it was picked: follow it now (rather
        than at the next health check) so that the request's next attempt goes elsewhere."""
        if status != 409 or PD_ROLE_CHANGED.encode() not in data:
            return False
        await self.check_instance(inst)
        return True

    async def _fetch_role(self, inst: Upstream, timeout: aiohttp.ClientTimeout) -> dict | None:
        """The instance's /pd_role answer: its PD role, block size and where it publishes its KV
        cache events; None when it does not say (an older server)."""
        try:
            async with self.session.get(inst.url + "/pd_role", headers=self._headers(), timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                info = await resp.json(content_type=None)
        except (*UPSTREAM_ERRORS, ValueError, AttributeError):
            return None
        return info if isinstance(info, dict) and isinstance(info.get("pd_role"), str) else None

    async def _fetch_load(self, inst: Upstream, timeout: aiohttp.ClientTimeout) -> InstanceLoad | None:
        """None when the metrics cannot be had (a separate --metrics-port, a metrics key): the
        instance is still up, least_load then goes by this router's own in-flight counts."""
        try:
            async with self.session.get(inst.url + "/metrics", headers=self._headers(), timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except UPSTREAM_ERRORS:
            return None
        return parse_instance_load(text)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop the checks for good
                logger.exception("Health check round failed")

    # --- cache_aware ---------------------------------------------------------------------------
    async def prompt_hashes(self, body: dict) -> list[bytes] | None:
        """The prompt's block hashes for the cache_aware policy: token-id prompts as they are, texts
        and chat messages tokenized by an instance's /tokenize (its chat template, the generation
        prompt added, as the request will be); None when they cannot be had (the policy then goes
        by load)."""
        sizes = [i.block_size for i in self.all_instances() if i.block_size]
        prompt = body.get("prompt")
        if not sizes:
            return None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt_block_hashes(prompt, sizes[0])
        if self.local_tokenizer is not None:
            tokens = await asyncio.to_thread(self.local_tokenizer.prompt_ids, body)
            return prompt_block_hashes(tokens, sizes[0]) if tokens else None
        fields = ("messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt")
        if isinstance(prompt, str):
            query: dict = {"prompt": prompt}
        elif isinstance(body.get("messages"), list):
            query = {"add_generation_prompt": True, **{k: body[k] for k in fields if k in body}}
        else:
            return None
        inst = next((i for i in self.all_instances() if i.healthy), None)
        if inst is None:
            return None
        try:
            status, data, _ = await self._exchange(None, inst, "POST", "/tokenize", json_body=query)
            tokens = json.loads(data).get("tokens") if status == 200 else None
        except (*UPSTREAM_ERRORS, ValueError, AttributeError):
            return None
        return prompt_block_hashes(tokens, sizes[0]) if isinstance(tokens, list) else None

    # --- one upstream exchange ---------------------------------------------------------------
    async def _open(
        self,
        request: Request | None,
        open_request: OpenRequest,
        method: str,
        path: str,
        *,
        json_body=None,
        data: bytes | None = None,
        request_id: str | None = None,
        content_type: str | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """Send the request and wait for the answer's headers (the client may leave meanwhile);
        trace_headers carry the router's trace context (tracing on)."""
        inst = open_request.instance
        self.metrics.requests.labels(instance=inst.url, role=inst.role).inc()

        async def send() -> aiohttp.ClientResponse:
            return await self.session.request(
                method,
                inst.url + path,
                json=json_body,
                data=data,
                headers=self._headers(request_id, content_type, trace_headers),
            )

        open_request.resp = await until_disconnected(request, send())
        return open_request.resp

    async def _exchange(
        self, request: Request | None, inst: Upstream, method: str, path: str, **kwargs
    ) -> tuple[int, bytes, str | None]:
        """A whole non-streamed request: (status, body, content type)."""
        open_request = OpenRequest(inst)
        try:
            resp = await self._open(request, open_request, method, path, **kwargs)
            data = await until_disconnected(request, resp.read())
            return resp.status, data, resp.headers.get("Content-Type")
        finally:
            open_request.release()
