"""The prefill/decode (PD) disaggregation router: one OpenAI-compatible HTTP front for a pool of
prefill instances and a pool of decode instances (ordinary splitserve OpenAI servers started with a
PD role).

A completion or chat request goes through two instances:

1. a prefill instance gets the request with `max_tokens: 1`, `stream: false` and
   `kv_transfer_params: {"do_remote_decode": true}`; it computes the prompt's KV, keeps it under a
   lease, and answers a normal completion JSON plus a top-level `kv_transfer_params` (where the KV
   waits; opaque to the router);
2. a decode instance gets the client's original body plus those `kv_transfer_params` and
   `do_remote_prefill: true`; it pulls the KV and generates. Its answer (JSON or SSE stream) goes
   back to the client byte for byte.

Three kinds of request run whole on one decode instance instead (prompt and output, no transfer): a
completion with several prompts; a beam search (`use_beam_search`), whose beams grow from the
prompt's KV step by step; and a request that scores its prompt (`prompt_logprobs`, or `echo` with
`logprobs`), whose logprobs come from the pass that computes the prompt. The answer is then what a
mixed instance gives.

Failures: a prefill instance that cannot be reached, times out, answers 5xx, or forgets the
`kv_transfer_params` is marked down and the next one is tried (--max-retries); when none succeeds
the request is decoded without remote prefill (a "fallback": the decode instance computes the
prompt itself, slower but correct). A 4xx from prefill means the request is invalid: it is returned
as is. A decode failure before the first byte reached the client is retried on another decode
instance; after that, the stream ends with an error event and `[DONE]`. A client that goes away
closes the upstream connection at once, so that the instance aborts the request and frees its KV.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from splitserve.disagg.policies import Upstream
from splitserve.entrypoints.http import error_response, parse_json_object, read_body, read_json_body
from splitserve.entrypoints.router.config import DECODE, PREFILL
from splitserve.entrypoints.router.control import broadcast_json
from splitserve.entrypoints.router.pool import UpstreamPool
from splitserve.entrypoints.router.relay import (
    UPSTREAM_ERRORS,
    ClientGone,
    OpenRequest,
    RelayResponse,
    decode_refused,
    decode_request_body,
    describe_error,
    fallback_request_body,
    first_chunk,
    is_batch,
    kv_params,
    prefill_request_body,
    relay_stream,
    scores_the_prompt,
    status_reason,
    unavailable_before_output,
    until_disconnected,
)
from splitserve.entrypoints.router.request_log import RoutedRequest

logger = logging.getLogger("splitserve.router")

_STREAMS = ("text/event-stream", "application/x-ndjson")  # OpenAI's server-sent events; /generate's JSON lines


class _Unavailable(Exception):
    """A decode instance's stream began with a 503 error event: nothing was generated, try another."""


# --- the router --------------------------------------------------------------------------------
class Router(UpstreamPool):
    """The request flow (independent of the routes), on the pool of instances it inherits."""

    # --- completions and chat ----------------------------------------------------------------
    async def handle_generation(self, request: Request, path: str, body: dict | None = None) -> Response:
        """A completion, chat or /generate request (its `body` read from `request` unless given)."""
        if body is None:
            body = await read_json_body(request)
        client_id = body.get("request_id") if isinstance(body.get("request_id"), str) else None
        # The client's id (header, else body) goes to both instances as X-Request-Id: /abort_requests names it.
        trace = RoutedRequest(request.headers.get("x-request-id") or client_id or uuid.uuid4().hex, path)
        trace.start_span(self.tracing, request.headers)
        if self.kv_index is not None:
            trace.hashes = await self.prompt_hashes(body)
        prefilled = None
        try:
            if self.answer_role != DECODE:  # plain replicas: the request runs whole on one
                return await self._decode(request, path, fallback_request_body(body), trace)
            if is_batch(body):  # PD moves one prompt's KV; a batch of prompts is decoded in one place
                trace.fallback = "a batch of prompts is decoded without remote prefill"
                prefilled = None
            elif body.get("use_beam_search") is True:
                # A beam search grows its beams' KV step by step from the prompt's: it runs whole
                # (prompt and steps) on one decode instance, which answers as a mixed instance would.
                trace.notes.append("beam search runs whole on a decode instance")
                return await self._decode(request, path, fallback_request_body(body), trace)
            elif scores_the_prompt(body):
                # The prompt's logprobs come from the pass that computes the prompt, which a decode
                # instance skips when it pulls the KV: such a request runs whole on one decode instance.
                trace.notes.append(
                    "prompt logprobs (prompt_logprobs, or echo with logprobs) run whole on a decode instance"
                )
                return await self._decode(request, path, fallback_request_body(body), trace)
            else:
                prefilled = await self._prefill(request, path, body, trace)
            if isinstance(prefilled, Response):
                return self._finish(trace, prefilled)
            if prefilled is None:
                self.metrics.fallbacks.inc()
                decode_body = fallback_request_body(body)
            else:
                decode_body = decode_request_body(body, prefilled)
            local_body = fallback_request_body(body) if prefilled is not None else None
            response = await self._decode(request, path, decode_body, trace, local_body)
            if prefilled is not None and (response.status_code != 200 or trace.decode == trace.prefill):
                await self._release_lease(trace, prefilled)  # not pulled: refused, or decoded where it was prefilled
            return response
        except ClientGone:
            trace.notes.append("the client disconnected (upstream request closed)")
            if isinstance(prefilled, dict):
                await self._release_lease(trace, prefilled)
            return self._finish(trace, Response(status_code=499))

    async def _release_lease(self, trace: RoutedRequest, kv: dict) -> None:
        """No decode instance will pull this prefill's KV: the prefill instance frees it now (POST
        /kv_transfer/release with its own kv_transfer_params) instead of when the lease expires."""
        inst = next((i for i in self.all_instances() if i.url == trace.prefill), None)  # it may have switched
        if inst is None:
            return
        try:
            status, data, _ = await self._exchange(
                None, inst, "POST", "/kv_transfer/release", json_body={"kv_transfer_params": kv}
            )
        except UPSTREAM_ERRORS as exc:
            trace.notes.append(f"the prefill KV lease could not be released ({describe_error(exc, 0)})")
            return
        if status == 200:
            trace.notes.append("the prefill KV lease released")
        else:
            trace.notes.append(f"the prefill KV lease could not be released ({status_reason(status, data)})")

    def _finish(self, trace: RoutedRequest, response: Response) -> Response:
        self._log_request(trace, response.status_code)
        return response

    def _log_request(self, trace: RoutedRequest, status: int) -> None:
        self.metrics.latency.observe(time.monotonic() - trace.started)
        logger.info("%s", trace.line(status))
        trace.end(status)

    def _attempts(self, role: str, body: dict, trace: RoutedRequest | None = None) -> Iterator[Upstream]:
        """The instances to try for one request, in the policy's order: at most 1 + max_retries,
        each tried once; for completions (with a trace) every attempt after the first counts as a retry."""
        tried: list[Upstream] = []
        for attempt in range(self.config.max_retries + 1):
            inst = self.pick(role, body, exclude=tried, hashes=trace.hashes if trace is not None else None)
            if inst is None:
                return
            if attempt and trace is not None:
                self.metrics.retries.labels(role=role).inc()
                trace.retries += 1
            tried.append(inst)
            yield inst

    async def _prefill(self, request: Request, path: str, body: dict, trace: RoutedRequest) -> dict | Response | None:
        """The prefill's kv_transfer_params; or the instance's 4xx answer to pass on; or None when no
        prefill instance could do it (then the request is decoded without remote prefill)."""
        prefill_body = prefill_request_body(body)
        reasons: list[str] = []
        for inst in self._attempts(PREFILL, body, trace):
            started = time.monotonic()
            span, trace_headers = trace.open_call(PREFILL, inst.url)
            try:
                status, data, content_type = await self._exchange(
                    request,
                    inst,
                    "POST",
                    path,
                    json_body=prefill_body,
                    request_id=trace.request_id,
                    trace_headers=trace_headers,
                )
            except UPSTREAM_ERRORS as exc:
                reason = describe_error(exc, self.config.request_timeout)
            else:
                trace.end_call(span, None if status < 400 else f"HTTP {status}")
                if status == 429:  # this instance is full, not the request invalid: try another one
                    reasons.append(f"{inst.url}: busy (429)")
                    continue
                if await self.role_changed(inst, status, data):
                    reasons.append(f"{inst.url}: no longer a prefill instance (409)")
                    continue
                if 400 <= status < 500:
                    trace.prefill = inst.url
                    trace.notes.append("the prefill instance refused the request")
                    return Response(data, status_code=status, media_type=content_type)
                kv = kv_params(data) if status < 300 else None
                if kv is not None:
                    trace.prefill, trace.prefill_s = inst.url, time.monotonic() - started
                    return kv
                if status < 300:
                    reason = "answered without kv_transfer_params (is it running as a prefill instance?)"
                    logger.warning("prefill instance %s %s", inst.url, reason)
                else:
                    reason = status_reason(status, data)
            trace.end_call(span, reason)
            self._failed(inst, reason)
            reasons.append(f"{inst.url}: {reason}")
        trace.fallback = "; ".join(reasons) if reasons else "no prefill instance is up"
        return None

    async def _decode(
        self, request: Request, path: str, body: dict, trace: RoutedRequest, local_body: dict | None = None
    ) -> Response:
        """The decode instance's answer: passed through as it comes. Failures before the first byte
        reached the client are retried on another decode instance; a 503 when none is left.
        `local_body`: what to send instead when the instance chosen is the one that prefilled the
        request (an instance switched to mixed takes both phases): it runs the request whole, its
        prompt found in its own prefix cache, rather than pulling the KV from itself."""
        reasons: list[str] = []
        for inst in self._attempts(self.answer_role, body, trace):
            trace.decode = inst.url
            json_body = body
            if local_body is not None and inst.url == trace.prefill:
                json_body = local_body
                trace.notes.append("decoded on the mixed instance that prefilled it, from its own prefix cache")
            open_request = OpenRequest(inst)
            handed_over = False
            span, trace_headers = trace.open_call(self.answer_role, inst.url)
            reason = None
            try:
                resp = await self._open(
                    request,
                    open_request,
                    "POST",
                    path,
                    json_body=json_body,
                    request_id=trace.request_id,
                    trace_headers=trace_headers,
                )
                if resp.status >= 500:
                    reason = status_reason(resp.status, await until_disconnected(request, resp.read()))
                elif resp.status == 200 and resp.content_type in _STREAMS:
                    first = await until_disconnected(request, first_chunk(resp))
                    unavailable = unavailable_before_output(first)
                    if unavailable is not None:  # the engine failed before this request's first token
                        reason = f"503 before the first token: {unavailable}"
                        raise _Unavailable(reason)
                    open_request.on_release = lambda: self._log_request(trace, 200)
                    handed_over = True
                    return RelayResponse(
                        relay_stream(self, open_request, first, trace), open_request, media_type=resp.content_type
                    )
                else:
                    data = await until_disconnected(request, resp.read())
                    if await self.role_changed(inst, resp.status, data):
                        reasons.append(f"{inst.url}: no longer a {self.answer_role} instance (409)")
                        continue
                    if resp.status == 404 and trace.prefill:
                        data = decode_refused(data, inst.url, trace)
                    return self._finish(
                        trace, Response(data, status_code=resp.status, media_type=resp.headers.get("Content-Type"))
                    )
            except UPSTREAM_ERRORS as exc:
                reason = describe_error(exc, self.config.request_timeout)
            except _Unavailable as exc:
                reason = str(exc)
            finally:
                if not handed_over:
                    open_request.release()
                    trace.end_call(span, reason)
            self._failed(inst, reason)
            reasons.append(f"{inst.url}: {reason}")
        if not reasons:
            reasons = [f"{i.url}: {i.down_reason or 'down'}" for i in self.instances[self.answer_role]]
            message = f"No {self.answer_role} instance is up (" + "; ".join(reasons) + ")."
        else:
            message = f"No {self.answer_role} instance could serve the request: " + "; ".join(reasons) + "."
        trace.notes.append(message)
        return self._finish(trace, error_response(message, 503, "service_unavailable"))

    # --- other routes ------------------------------------------------------------------------
    async def forward(self, request: Request, method: str, path: str) -> Response:
        """/v1/models, /tokenize, /detokenize, /version: any up decode instance answers them (all
        serve the same model); retried on another one on a connection error or 5xx."""
        data = await read_body(request) if method == "POST" else None
        if data is not None:
            parse_json_object(data)  # the same limits as the instances': refused here, as there
        content_type = request.headers.get("content-type") if method == "POST" else None
        reasons: list[str] = []
        for inst in self._attempts(self.answer_role, {}):
            try:
                status, body, ctype = await self._exchange(
                    request, inst, method, path, data=data, content_type=content_type
                )
            except ClientGone:
                return Response(status_code=499)
            except UPSTREAM_ERRORS as exc:
                reason = describe_error(exc, self.config.request_timeout)
            else:
                if status < 500:
                    return Response(body, status_code=status, media_type=ctype)
                reason = status_reason(status, body)
            self._failed(inst, reason)
            reasons.append(f"{inst.url}: {reason}")
        detail = "; ".join(reasons) or "none is up"
        return error_response(
            f"No {self.answer_role} instance could answer {path}: {detail}.", 503, "service_unavailable"
        )

    async def broadcast(self, request: Request, path: str) -> Response:
        """/v1/load_lora_adapter, /v1/unload_lora_adapter and /abort_requests: on every instance,
        prefill and decode (control.py)."""
        return await broadcast_json(self, request, path)

    def health(self) -> Response:
        """200 when every serving role has an up instance; otherwise a 503 saying which has none and why."""
        roles = self.config.serving_roles
        missing = [role for role in roles if not self.healthy(role)]
        if missing:
            why = "; ".join(f"{i.url}: {i.down_reason or 'down'}" for role in missing for i in self.instances[role])
            return error_response(f"No {' and no '.join(missing)} instance is up ({why}).", 503, "service_unavailable")
        return JSONResponse({"status": "ok", **{role: len(self.healthy(role)) for role in roles}})
