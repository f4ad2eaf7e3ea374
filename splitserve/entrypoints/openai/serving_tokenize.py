"""/tokenize and /detokenize: the routes about the model and its vocabulary rather than
generation, so nothing here is checked against the context or the queue."""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai import chat_images
from splitserve.entrypoints.openai.encoding import json_response
from splitserve.entrypoints.openai.response_models import DetokenizeResponse, TokenizeResponse
from splitserve.entrypoints.openai.serving_base import OpenAIServing
from splitserve.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    parse_tokenize_request,
)


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, body: dict) -> JSONResponse:
        req = self._parse(parse_tokenize_request, body)
        await self._check_model(req.model)
        prompt = await self._render_chat(req) if isinstance(req, TokenizeChatRequest) else req.prompt
        ids = await chat_images.prompt_token_ids(self.processor, prompt, req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response(
            TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)
        )

    async def detokenize(self, body: dict) -> JSONResponse:
        req: DetokenizeRequest = self._parse(DetokenizeRequest.model_validate, body)
        await self._check_model(req.model)
        vocab_size = self.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"Token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1}).", param="tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens)
        return json_response(DetokenizeResponse(prompt=text))
