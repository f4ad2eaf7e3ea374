"""/generate: vLLM's native API (the Ascend guide's USE_OPENAI=0), served beside the OpenAI routes.

    POST /generate {"prompt": "...", "stream": false, <SamplingParams fields: n, max_tokens, temperature, ...>}
    -> {"text": ["<prompt><output 0>", "<prompt><output 1>", ...]}

With "stream": true the answer is newline-delimited JSON, one {"text": [...]} line per step, each
holding the texts so far (as vLLM's api_server streams them). The fields, their checks and their
defaults are those of /v1/completions (beam search, structured output and PD transfer included).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from splitserve.engine.async_llm import EngineDeadError
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.entrypoints.http import error_body
from splitserve.entrypoints.openai.control_protocol import GenerateRequest
from splitserve.entrypoints.openai.encoding import merge_streams
from splitserve.entrypoints.openai.response_models import random_id
from splitserve.entrypoints.openai.serving_base import OpenAIServing


class NativeServing(OpenAIServing):
    async def generate(self, body: dict, raw: Request):
        arrival = time.monotonic()
        req, params, lora = await self._accept(GenerateRequest, body)
        params = await self._process_params(req, params)
        kv = self._kv_transfer(req, params, 1)
        prompt = self._remote_prompt(req, kv) or (
            {"prompt_token_ids": req.prompt} if isinstance(req.prompt, list) else req.prompt
        )
        (request,) = await self._process([prompt], params, "prompt")
        request_id = random_id("generate")
        self._log(request_id, [request], params)
        prefix = self._prompt_text(request)
        if req.stream:
            streams = self._generation_streams(
                req, request_id, [request], arrival, RequestOutputKind.CUMULATIVE, kv, lora
            )
            return StreamingResponse(self._stream(streams, prefix), media_type="application/x-ndjson")
        streams = self._generation_streams(req, request_id, [request], arrival, RequestOutputKind.FINAL_ONLY, kv, lora)
        (final,) = await self._collect(streams, raw)
        self._record_finished(final)
        answer = {"text": [prefix + c.text for c in final.outputs]}
        kv_answer = self._kv_answer(kv, request, final)
        if kv_answer is not None:
            answer["kv_transfer_params"] = kv_answer
        return JSONResponse(answer)

    async def _stream(self, streams, prefix: str) -> AsyncIterator[str]:
        try:
            async for _, output in merge_streams(streams):
                if output.finished:
                    self._record_finished(output)
                yield json.dumps({"text": [prefix + c.text for c in output.outputs]}) + "\n"
        except EngineDeadError as exc:
            yield json.dumps(error_body(str(exc), "service_unavailable", None, 503)) + "\n"
