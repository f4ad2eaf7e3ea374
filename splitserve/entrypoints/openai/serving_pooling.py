"""/v1/embeddings, /score, /rerank and /classify: the pooling runner's routes (docs/pooling.md).
Each input is one pooling request to the engine (its prompt pooled into an embedding, or, for a
classification model, into its labels' logits). Score and rerank are the cosine similarities of
embeddings for an embedding model, as vLLM computes them, and for a cross-encoder (a classifier of
one label) the sigmoid of its logit for the (query, document) pair read together."""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from splitserve.engine.output_processor import RequestOutputKind
from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.encoding import json_response
from splitserve.entrypoints.openai.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from splitserve.entrypoints.openai.response_models import random_id
from splitserve.entrypoints.openai.serving_base import OpenAIServing
from splitserve.outputs import RequestOutput
from splitserve.pooling_params import PoolingParams, classifier_activation, cosine_similarity, is_classifier

logger = logging.getLogger("splitserve.api_server")


def _engine_prompt(prompt: str | list[int]):
    return {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt


class OpenAIServingPooling(OpenAIServing):
    def _check_runner(self, route: str) -> None:
        if self.model_config.runner_type != "pooling":
            raise APIError(
                f"{route} needs an embedding model: this server runs the generate runner. Start it with "
                "--runner pooling (or --task embed) to serve embeddings, score and rerank.",
                400,
            )

    @property
    def classifier(self) -> bool:
        return is_classifier(self.model_config.hf_config)

    async def _embed(
        self, inputs: list, pooling: PoolingParams, raw: Request, param: str, lora=None, add_special_tokens=True
    ) -> list[RequestOutput]:
        """Each input's finished pooling request, in order (lora: the adapter the model name asked for)."""
        self._check_capacity()

        def process():
            return [
                self.processor.process_pooling(
                    _engine_prompt(p), pooling, add_special_tokens=add_special_tokens, param=param
                )
                for p in inputs
            ]

        requests = await asyncio.to_thread(process)
        request_id = random_id("embd")
        if not self.server_args.disable_log_requests:
            logger.info(
                "Request %s: %d input(s) of %s tokens to embed",
                request_id,
                len(requests),
                [len(r.prompt_token_ids) for r in requests],
            )
        arrival = time.monotonic()
        streams = self._streams(request_id, requests, arrival, RequestOutputKind.FINAL_ONLY, None, lora)
        return await self._collect(streams, raw)

    async def create_embedding(self, body: dict, raw: Request) -> JSONResponse:
        req: EmbeddingRequest = self._parse(EmbeddingRequest.model_validate, body)
        lora = await self._check_model(req.model)
        self._check_runner("/v1/embeddings")
        if self.classifier:
            raise APIError(
                "This server runs a classification model (a reranker or classifier): it answers /score, /rerank "
                "and /classify, not embeddings.",
                param="model",
            )
        pooling = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        finals = await self._embed(req.inputs(), pooling, raw, "input", lora, req.add_special_tokens)
        data = [
            EmbeddingData(index=i, embedding=_encode(out.pooled, req.encoding_format)) for i, out in enumerate(finals)
        ]
        tokens = sum(len(out.prompt_token_ids) for out in finals)
        usage = PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return json_response(EmbeddingResponse(model=self._response_model(req), data=data, usage=usage))

    async def _similarities(self, queries: list, documents: list, raw: Request, param: str, lora) -> tuple[list, int]:
        """Cosine similarities of (query, document) pairs, vLLM's pairing: one query against every
        document, or as many queries as documents, pairwise. Returns (scores, tokens embedded)."""
        if len(queries) != 1 and len(queries) != len(documents):
            raise APIError(
                f"Score pairs the texts one to one, or one against many: got {len(queries)} and {len(documents)}.",
                param=param,
            )
        if self.classifier:
            return await self._cross_encode(queries, documents, raw, param, lora)
        finals = await self._embed(queries + documents, PoolingParams(), raw, param, lora)
        first, second = finals[: len(queries)], finals[len(queries) :]
        if len(first) == 1:
            first = first * len(second)
        scores = [cosine_similarity(a.pooled, b.pooled) for a, b in zip(first, second)]
        return scores, sum(len(out.prompt_token_ids) for out in finals)

    async def create_score(self, body: dict, raw: Request) -> JSONResponse:
        req: ScoreRequest = self._parse(ScoreRequest.model_validate, body)
        lora = await self._check_model(req.model)
        self._check_runner("/score")
        try:
            queries, documents = req.sides()
        except ValueError as exc:
            raise APIError(str(exc), param="text_1") from None
        scores, tokens = await self._similarities(queries, documents, raw, "text_2", lora)
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        usage = PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return json_response(ScoreResponse(model=self._response_model(req), data=data, usage=usage))

    async def create_rerank(self, body: dict, raw: Request) -> JSONResponse:
        req: RerankRequest = self._parse(RerankRequest.model_validate, body)
        lora = await self._check_model(req.model)
        self._check_runner("/rerank")
        scores, tokens = await self._similarities([req.query], list(req.documents), raw, "documents", lora)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=self._text(req.documents[i])) if req.return_documents else None,
            )
            for i in order
        ]
        usage = PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return json_response(RerankResponse(model=self._response_model(req), usage=usage, results=results))

    async def _cross_encode(self, queries: list, documents: list, raw: Request, param: str, lora) -> tuple[list, int]:
        """A cross-encoder's scores: each (query, document) pair read together, its one logit's sigmoid."""
        num_labels = getattr(self.model_config.hf_config, "num_labels", 1)
        if num_labels != 1:
            raise APIError(
                f"Scoring needs a cross-encoder of one label; this model has {num_labels}: use /classify.", param=param
            )
        if len(queries) == 1:
            queries = queries * len(documents)
        pairs = await asyncio.to_thread(lambda: [self.processor.pair_prompt(q, d) for q, d in zip(queries, documents)])
        finals = await self._embed([p["prompt_token_ids"] for p in pairs], PoolingParams(), raw, param, lora)
        scores = [classifier_activation(out.pooled)[0] for out in finals]
        return scores, sum(len(out.prompt_token_ids) for out in finals)

    async def create_classify(self, body: dict, raw: Request) -> JSONResponse:
        req: ClassificationRequest = self._parse(ClassificationRequest.model_validate, body)
        lora = await self._check_model(req.model)
        self._check_runner("/classify")
        if not self.classifier:
            raise APIError("/classify needs a classification model (*ForSequenceClassification).", param="model")
        finals = await self._embed(req.inputs(), PoolingParams(), raw, "input", lora, req.add_special_tokens)
        labels = getattr(self.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, out in enumerate(finals):
            probs = classifier_activation(out.pooled)
            best = max(range(len(probs)), key=probs.__getitem__)
            label = str(labels.get(best, labels.get(str(best), f"LABEL_{best}")))
            data.append(ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs)))
        tokens = sum(len(out.prompt_token_ids) for out in finals)
        usage = PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return json_response(ClassificationResponse(model=self._response_model(req), data=data, usage=usage))

    def _text(self, document: str | list[int]) -> str:
        return document if isinstance(document, str) else self.tokenizer.decode(document)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the float32 values, little-endian, base64-encoded."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector
