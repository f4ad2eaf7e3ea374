"""The OpenAI endpoints' side of prefill/decode disaggregation: the router's kv_transfer_params read
and checked, the prompt a decode request carries, and where a prefill instance's answer says its KV
waits. The transfer itself is distributed/kv_transfer/; the engine's side is engine/core/pd.py."""

from __future__ import annotations

import msgspec
from pydantic import ValidationError

from splitserve.engine.async_llm import EngineDeadError
from splitserve.engine.messages import KVTransferParams
from splitserve.engine.pd_role import PDRoleState
from splitserve.engine.processor import ProcessedRequest, PromptType
from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.control_protocol import (
    KVReleaseRequest,
    KVReleaseResponse,
    PDRoleSwitch,
    PDRoleSwitched,
)
from splitserve.multimodal.inputs import placement
from splitserve.outputs import RequestOutput
from splitserve.sampling_params import SamplingParams
from splitserve.tracing import REQUEST_TRACE

PD_ROLE_CHANGED = "pd_role_changed"  # the error type of the 409 (the router follows the instance on it)


class PDServingMixin:
    """Mixed into OpenAIServing, whose `roles` (engine/pd_role.py) and `engine` it reads."""

    roles: PDRoleState

    @property
    def pd_role(self) -> str:
        return self.roles.role

    def switch_pd_role(self, body: dict) -> PDRoleSwitched:
        """POST /pd_role: take another PD role while serving (engine/pd_role.py says what happens to
        the work in flight); the answer gives the previous role and the new epoch."""
        try:
            role = PDRoleSwitch.model_validate(body).pd_role
        except ValidationError:
            raise APIError('The body must be {"pd_role": "prefill" | "decode" | "mixed"}.', param="pd_role") from None
        try:
            previous, epoch = self.roles.switch(role)
        except ValueError as exc:
            raise APIError(str(exc), param="pd_role") from None
        return PDRoleSwitched(pd_role=role, previous_pd_role=previous, epoch=epoch)

    def _check_role(self, kv: KVTransferParams) -> None:
        """A request meant for another role than this instance's (it switched since the router chose
        it): a 409 naming the role it has now, so that the router follows and sends it elsewhere."""
        needed = self.roles.takes(kv.do_remote_decode, kv.do_remote_prefill)
        if needed is not None:
            raise APIError(
                f"This instance is now a {self.pd_role} instance (PD role epoch {self.roles.epoch}); the request "
                f"needs a {needed} instance.",
                409,
                PD_ROLE_CHANGED,
                param="kv_transfer_params",
            )

    async def release_kv_lease(self, body: dict) -> KVReleaseResponse:
        """POST /kv_transfer/release (prefill instances): the router hands back a prefill answer's
        kv_transfer_params when no decode instance will pull them (the decode side failed, or the
        client left), and the leased blocks are freed now rather than when the lease expires. An
        unknown or already ended lease is no error: the call may race the last pull."""
        if not self.roles.switchable:  # a former prefill instance still holds its leases
            raise APIError(f"Only a prefill instance holds KV leases; this one is a {self.pd_role} instance.")
        try:
            req = KVReleaseRequest.model_validate(body)
        except ValidationError:
            raise APIError(
                'The body must be {"kv_transfer_params": {"remote_request_id": ...}}, as a prefill answer gave it.',
                param="kv_transfer_params",
            ) from None
        rid = req.kv_transfer_params.remote_request_id
        try:
            await self.engine.release_kv_leases([rid])
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable") from None
        return KVReleaseResponse(released=rid)

    def _kv_transfer(self, req, params: SamplingParams, num_prompts: int) -> KVTransferParams | None:
        """The router's kv_transfer_params. A prefill answer must be one whole JSON with where its KV
        waits, so it cannot stream; its n samples (best_of of them when more) become one prefill
        whose KV is pulled once per sample: no lease is left for samples nobody decodes."""
        raw = req.kv_transfer_params
        if raw is None:
            return None
        if not self.roles.switchable:
            raise APIError(
                "kv_transfer_params need a prefill or decode instance; this one runs with --pd-role mixed.",
                param="kv_transfer_params",
            )
        if num_prompts != 1:
            raise APIError("With kv_transfer_params a request must hold exactly one prompt.", param="prompt")
        try:
            kv = msgspec.convert(raw, KVTransferParams)
        except msgspec.ValidationError as exc:
            raise APIError(f"Invalid kv_transfer_params: {exc}", param="kv_transfer_params") from None
        self._check_role(kv)
        if kv.do_remote_decode:
            if req.stream:
                raise APIError("A prefill request (do_remote_decode) cannot stream.", param="stream")
            kv.remote_num_pulls = max(params.n, params.best_of or 1)
            params.n, params.best_of = 1, None
        if kv.do_remote_prefill and None in (kv.remote_host, kv.remote_port, kv.remote_request_id):
            raise APIError(
                "do_remote_prefill needs remote_host, remote_port and remote_request_id.", param="kv_transfer_params"
            )
        trace = REQUEST_TRACE.get()
        if trace is not None and kv.do_remote_prefill:  # the request's first phase is the KV pull
            trace.remote_prefill = True
        return kv

    @staticmethod
    def _remote_prompt(req, kv: KVTransferParams | None) -> PromptType | None:
        """A decode request carries the token ids the prefill instance computed: using them (rather
        than tokenizing again) guarantees the pulled KV belongs to exactly this prompt."""
        ids = (req.kv_transfer_params or {}).get("prompt_token_ids") if kv and kv.do_remote_prefill else None
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise APIError(
                "kv_transfer_params.prompt_token_ids must be a list of token ids.", param="kv_transfer_params"
            )
        placements = req.kv_transfer_params.get("mm_placements")  # its images, encoded by the prefill instance
        return {"prompt_token_ids": ids, "mm_placements": placements} if placements else {"prompt_token_ids": ids}

    @staticmethod
    def _kv_answer(kv: KVTransferParams | None, request: ProcessedRequest, output: RequestOutput) -> dict | None:
        if kv is None or not kv.do_remote_decode or output.kv_transfer_params is None:
            return None
        answer = {**output.kv_transfer_params, "prompt_token_ids": request.prompt_token_ids}
        if request.mm_features:
            answer["mm_placements"] = [placement(feature) for feature in request.mm_features]
        return answer
