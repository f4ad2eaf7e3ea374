"""Output processing: core token outputs -> RequestOutputs with text, logprobs and stop strings.

A user request with n > 1 fans out into n core requests (the samples share the prompt's KV
blocks through the prefix cache); their outputs are gathered back here into one RequestOutput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import msgspec

from splitserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.messages import EngineCoreOutput, TokenLogprobs
from splitserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from splitserve.sampling_params import SamplingParams


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SampleState:
    """One sample (one core request) of a user request."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    samples: dict[str, SampleState]  # core request id -> sample
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    kv_transfer_params: dict | None = None
    # best_of > n: (n, whether the caller asked for logprobs): the best n samples are returned
    best_of: tuple[int, bool] | None = None
    error: InvalidRequestError | None = None  # the engine refused the request
    pooled: list[float] | None = None  # a pooling request's embedding

    @property
    def finished(self) -> bool:
        if len(self.samples) == 1:  # most requests (n=1): no generator per call
            for sample in self.samples.values():
                return sample.finish_reason is not None
        return all(s.finished for s in self.samples.values())


FINAL_ONLY = RequestOutputKind.FINAL_ONLY


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}  # a token id's text alone (logprobs'), decoded once
        self.requests: dict[str, RequestState] = {}
        self.core_to_request: dict[str, str] = {}
        self.on_inter_token = None  # callback(seconds between a request's successive tokens), for metrics
        self.stream_interval = 1  # streamed (DELTA) outputs every this many tokens, the first at once

    def add_request(self, state: RequestState) -> None:
        if state.request_id in self.requests:
            raise ValueError(f"Request id {state.request_id!r} is already in use.")
        self.requests[state.request_id] = state
        for core_id in state.samples:
            self.core_to_request[core_id] = state.request_id

    def new_detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )

    def abort(self, request_ids) -> list[str]:
        """Forget user requests; returns the core request ids to abort."""
        core_ids = []
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                core_ids.extend(state.samples)
                for core_id in state.samples:
                    self.core_to_request.pop(core_id, None)
        return core_ids

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply core outputs. Returns the RequestOutputs to hand out (an InvalidRequestError, with
        its request_id, in place of one the engine refused) and the core request ids that stopped on
        a stop string (the core must abort them)."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            rid = self.core_to_request.get(out.request_id)
            if rid is None:
                continue  # aborted while the step ran
            state = self.requests[rid]
            sample = state.samples[out.request_id]
            if sample.finished:  # a stop string ended it: the core's next tokens (sent before the abort) go
                continue
            if out.new_prompt_logprobs:
                self._add_prompt_logprobs(state, out.new_prompt_logprobs)
            if out.pooled is not None:
                state.pooled = out.pooled
            if out.kv_transfer is not None:
                state.kv_transfer_params = msgspec.structs.asdict(out.kv_transfer)
            if out.first_scheduled_time is not None:
                state.metrics.first_scheduled_time = min(
                    out.first_scheduled_time, state.metrics.first_scheduled_time or float("inf")
                )
            if out.new_token_ids:
                self._update_metrics(state.metrics, now)
                if out.num_cached_tokens > state.num_cached_tokens:
                    state.num_cached_tokens = out.num_cached_tokens
                if sample.detokenizer is None and out.new_logprobs is None and not out.finished:
                    _add_plain_tokens(sample, out)  # no text, no stop strings, no top logprobs to look at
                elif self._add_tokens(sample, out):
                    to_abort.append(out.request_id)
            elif out.finished:  # ended without a token: aborted before it ran, or refused
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if out.error is not None:
                status = out.error_status or (404 if out.error_not_found else 400)
                state.error = InvalidRequestError(out.error, "model" if status == 404 else None, status)
                state.error.request_id = rid
            touched[rid] = state
        results = []
        for rid, state in touched.items():
            if state.kind is FINAL_ONLY and state.error is None and not state.finished:
                continue  # the most common request offline: nothing to hand out until it ends
            if not self._due(state):
                continue
            result = state.error if state.error is not None else self._make_output(state)
            if result is not None:
                results.append(result)
            if state.finished:
                state.metrics.finished_time = now
                self.abort([rid])
        return results, to_abort

    def _due(self, state: RequestState) -> bool:
        """Whether a streamed request's output goes out now (--stream-interval): its first token at
        once, then every `stream_interval` tokens of a sample, and whatever ends it or fails it."""
        if self.stream_interval == 1 or state.kind != RequestOutputKind.DELTA or state.finished or state.error:
            return True
        return any(
            (s.sent_tokens == 0 and s.token_ids) or len(s.token_ids) - s.sent_tokens >= self.stream_interval
            for s in state.samples.values()
        )

    def _update_metrics(self, metrics: RequestMetrics, now: float) -> None:
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        elif self.on_inter_token is not None and now > metrics.last_token_time:
            self.on_inter_token(now - metrics.last_token_time)
        metrics.last_token_time = now

    def _add_tokens(self, sample: SampleState, out: EngineCoreOutput) -> bool:
        """Take the output's tokens one by one (speculative decoding sends several): a stop string
        ends the sample at the token that completed it, and the tokens after it are dropped. True
        when a stop string ended the sample here."""
        params = sample.params
        # The core stops on eos / stop_token_ids only, and that token is the step's last (speculative
        # decoding's accepted run is cut there): its text is left out unless asked for, the text of
        # the tokens accepted before it is not.
        stop_token_at = len(out.new_token_ids) - 1 if out.finish_reason == "stop" else -1
        if params.include_stop_str_in_output:
            stop_token_at = -1
        for i, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            if out.new_logprobs is not None:
                self._add_sample_logprobs(sample, out.new_logprobs[i])
            elif out.new_token_logprobs is not None:  # AIAK's cum_log_probs on every choice
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + out.new_token_logprobs[i]
            if sample.detokenizer is None or i == stop_token_at:
                continue
            new_chars = len(sample.detokenizer.add_token(token))
            sample.text = sample.detokenizer.output_text
            if params.stop and len(sample.token_ids) >= params.min_tokens:
                hit = find_stop_string(sample.text, new_chars, params.stop, params.include_stop_str_in_output)
                if hit is not None:
                    sample.text = sample.text[: hit[1]]
                    sample.finish_reason, sample.stop_reason = "stop", hit[0]
                    return not out.finished or i + 1 < len(out.new_token_ids)
        if out.finished:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _add_sample_logprobs(self, sample: SampleState, entry: TokenLogprobs) -> None:
        if sample.logprobs is None:
            sample.logprobs, sample.cumulative_logprob = [], 0.0
        sample.logprobs.append(self._logprob_dict(entry, sample.params.detokenize))
        sample.cumulative_logprob += entry[1][0]

    def _add_prompt_logprobs(self, state: RequestState, entries: list[TokenLogprobs]) -> None:
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        state.prompt_logprobs.extend(self._logprob_dict(e, True) for e in entries)

    def _logprob_dict(self, entry: TokenLogprobs, detokenize: bool) -> dict[int, Logprob]:
        ids, lps, chosen_rank = entry
        result = {}
        for pos, (tid, lp) in enumerate(zip(ids, lps)):
            if tid in result:
                continue
            text = None
            if detokenize:
                text = self.token_texts.get(tid)
                if text is None:
                    text = self.token_texts[tid] = self.tokenizer.decode([tid])
            result[tid] = Logprob(lp, chosen_rank if pos == 0 else pos, text)
        return result

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        if state.kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        delta = state.kind == RequestOutputKind.DELTA
        completions = [self._completion(s, delta) for s in sorted(state.samples.values(), key=lambda s: s.index)]
        num_generated = sum(len(s.token_ids) for s in state.samples.values())
        if state.best_of is not None:
            completions = _best_of(completions, *state.best_of)
        prompt_logprobs = state.prompt_logprobs
        if delta and state.sent_prompt_logprobs:
            prompt_logprobs = None
        state.sent_prompt_logprobs = state.sent_prompt_logprobs or prompt_logprobs is not None
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            prompt_logprobs,
            completions,
            state.finished,
            state.num_cached_tokens,
            state.metrics,
            state.kv_transfer_params,
            num_generated,
            state.pooled,
        )

    @staticmethod
    def _completion(sample: SampleState, delta: bool) -> CompletionOutput:
        text = sample.text
        if not sample.finished and sample.params.stop:
            # Hold back what may still turn out to be the start of a stop string.
            text = text[: max(len(text) - sample.params.max_stop_str_len + 1, sample.sent_chars)]
        if not delta:
            return CompletionOutput(
                sample.index,
                text,
                list(sample.token_ids),
                sample.cumulative_logprob,
                sample.logprobs,
                sample.finish_reason,
                sample.stop_reason,
            )
        out = CompletionOutput(
            sample.index,
            text[sample.sent_chars :],
            sample.token_ids[sample.sent_tokens :],
            sample.cumulative_logprob,
            None if sample.logprobs is None else sample.logprobs[sample.sent_logprobs :],
            sample.finish_reason,
            sample.stop_reason,
        )
        sample.sent_chars, sample.sent_tokens = len(text), len(sample.token_ids)
        sample.sent_logprobs = len(sample.logprobs or ())
        return out


def _add_plain_tokens(sample: SampleState, out: EngineCoreOutput) -> None:
    """_add_tokens for a sample that is not detokenized and asked for no top logprobs, of an output
    that does not finish it: the tokens, and their logprobs into cumulative_logprob."""
    sample.token_ids.extend(out.new_token_ids)
    if out.new_token_logprobs is not None:  # AIAK's cum_log_probs on every choice, added as _add_tokens does
        total = sample.cumulative_logprob or 0.0
        for logprob in out.new_token_logprobs:
            total += logprob
        sample.cumulative_logprob = total


def _best_of(completions: list[CompletionOutput], n: int, keep_logprobs: bool) -> list[CompletionOutput]:
    """The n samples with the highest cumulative logprob, indexed 0..n-1 (vLLM's best_of)."""
    ranked = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
    for index, completion in enumerate(ranked):
        completion.index = index
        if not keep_logprobs:
            completion.logprobs = None
    return ranked
