"""The engine's side of speculative decoding: proposing each running request's drafts after a step
(n-gram and suffix proposers run here on token ids; a draft model's proposals come back from the
model runner), turning a verified step's result into each request's new tokens, and counting what
was drafted and accepted (vLLM's spec-decode metrics).

Without a speculative_config the same functions give one token per sampling request, so the
engine has one code path.
"""

from __future__ import annotations

import logging

from splitserve.engine.core.request import Request
from splitserve.engine.core.schedule_plan import SchedulePlan
from splitserve.engine.messages import SpecDecodingStats
from splitserve.executor.step_input import ModelRunnerOutput, TokenLogprobs
from splitserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


class Speculator:
    def __init__(self, config: SpeculativeConfig | None, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats()
        self.proposer = _model_free_proposer(config)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    # --- after a step ---------------------------------------------------------------------------
    def new_tokens(self, sched: SchedulePlan, result: ModelRunnerOutput) -> dict[str, list[int]]:
        """Each sampling request's tokens from this step: its accepted drafts, then the token the
        target sampled after them."""
        if not sched.spec_tokens:  # nothing was verified: each request's one sampled token
            return {rid: [token] for rid, token in result.sampled.items()}
        tokens = {}
        for rid, token in result.sampled.items():
            accepted = result.num_accepted.get(rid, 0)
            drafts = sched.spec_tokens.get(rid, [])
            tokens[rid] = drafts[:accepted] + [token]
            if drafts:
                self.stats.add(len(drafts), accepted)
        return tokens

    @staticmethod
    def logprobs(request: Request, result: ModelRunnerOutput):
        """(top logprobs, token logprobs) of the request's new tokens, one entry each, or None."""
        rid, n = request.request_id, len(request.new_token_ids)
        if rid not in result.num_accepted:  # one token, no drafts: the common case, without lists to cut
            entry, token_logprob = result.logprobs.get(rid), result.sampled_logprobs.get(rid)
            return (
                None if entry is None or not n else [entry],
                None if token_logprob is None or not n else [token_logprob],
            )
        top: list[TokenLogprobs] | None = None
        if rid in result.logprobs:
            top = (result.accepted_logprobs.get(rid, []) + [result.logprobs[rid]])[:n]
        token: list[float] | None = None
        if rid in result.sampled_logprobs:
            token = (result.accepted_token_logprobs.get(rid, []) + [result.sampled_logprobs[rid]])[:n]
        return top, token

    def propose(self, running: list[Request], draft_proposals: dict[str, list[int]]) -> None:
        """The drafts each running request verifies in its next step: a draft model's (from the
        step's result) or the engine's proposer's; none while the batch is large."""
        if self.config is None:
            return
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return
        for request in running:
            room = self._room(request)
            if room < 1:
                continue
            if self.proposer is not None:
                request.spec_token_ids = self.proposer.propose(request.request_id, request.all_token_ids, room)
            else:
                request.spec_token_ids = draft_proposals.get(request.request_id, [])[:room]

    def _room(self, request: Request) -> int:
        """How many drafts can still become output: the request decodes its last token next, and
        drafts past max_tokens or max_model_len would be verified for nothing."""
        if request.num_computed_tokens != request.num_tokens - 1 or request.keeps_kv_for_remote_decode:
            return 0
        left = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        return min(self.config.num_speculative_tokens, left)

    def finish(self, request: Request) -> None:
        if self.proposer is None:
            return
        if self.config.method == "suffix":
            self.proposer.finish(request.request_id, request.all_token_ids, request.num_prompt_tokens)
        else:
            self.proposer.finish(request.request_id, request.all_token_ids)


def _model_free_proposer(config: SpeculativeConfig | None):
    if config is None or config.method == "draft_model":
        return None
    logger.info("Speculative decoding: %s", config.describe())
    if config.method == "ngram":
        from splitserve.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from splitserve.spec_decode.suffix import SuffixProposer

    return SuffixProposer(
        config.suffix_decoding_max_tree_depth,
        config.suffix_decoding_max_cached_requests,
        config.suffix_decoding_max_spec_factor,
        config.suffix_decoding_min_token_prob,
    )
