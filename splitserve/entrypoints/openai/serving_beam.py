"""Beam search behind the OpenAI endpoints (`use_beam_search`): each prompt's search runs as steps of
one-token requests, one per live beam, sent to the engine together (engine/beam_search.py). Its
result is one RequestOutput whose choices are the n best hypotheses, so that the endpoints answer it
as any other request (streamed, it arrives as one chunk per choice)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from splitserve.engine.beam_search import BeamSearch, beam_prompt, step_params, top_candidates
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.engine.processor import ProcessedRequest
from splitserve.outputs import CompletionOutput, RequestOutput
from splitserve.sampling_params import BeamSearchParams


async def beam_search_output(
    engine,
    request_id: str,
    request: ProcessedRequest,
    params: BeamSearchParams,
    n: int,
    stop_ids: set[int],
    lora=None,
) -> AsyncIterator[RequestOutput]:
    """The search of one prompt; yields its RequestOutput once the search ends. Closing the iterator
    (a client that left) stops the search; requests of an unfinished step are aborted with it."""
    search = BeamSearch(len(request.prompt_token_ids), params, stop_ids)
    step = 0
    while not search.done:
        one_token = step_params(search)
        beams = [
            _next_token(engine, f"{request_id}-s{step}b{i}", beam_prompt(request, beam.tokens, one_token), lora)
            for i, beam in enumerate(search.live)
        ]
        search.step(list(await asyncio.gather(*beams)))
        step += 1
    yield _request_output(engine, request_id, request, search.results(n))


async def _next_token(engine, request_id: str, request: ProcessedRequest, lora) -> list[tuple[int, float]]:
    final = None
    async for output in engine.generate(request_id, request, kind=RequestOutputKind.FINAL_ONLY, lora_request=lora):
        final = output
    return top_candidates(final.outputs[0].logprobs[0])


def _request_output(engine, request_id: str, request: ProcessedRequest, beams) -> RequestOutput:
    tokenizer = engine.get_tokenizer()
    skip = request.params.skip_special_tokens
    completions = [
        CompletionOutput(
            index,
            tokenizer.decode(beam.tokens, skip_special_tokens=skip),
            beam.tokens,
            beam.score,
            None,
            "stop" if beam.stopped else "length",
        )
        for index, beam in enumerate(beams)
    ]
    return RequestOutput(
        request_id,
        request.prompt,
        request.prompt_token_ids,
        None,
        completions,
        True,
        num_generated_tokens=sum(len(beam.tokens) for beam in beams),
    )
