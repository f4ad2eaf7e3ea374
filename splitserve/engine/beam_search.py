"""Beam search, step by step, as transformers' `generate(num_beams=..., length_penalty=...,
early_stopping=...)` does it, over any front-end that can extend a sequence by one token with its
top log-probabilities (the offline LLM, the API server).

Each step every live beam is extended by one token: the candidates are the top K tokens of every
beam (K = (1 + number of stop tokens) x beam width, transformers' `beams_to_keep`), scored by the
beam's log-probability plus the token's, in float32 as transformers adds them. Candidates that end
(a stop token, or the length limit) may join the finished hypotheses, scored by their sum divided
by generated_length ** length_penalty; the best `beam_width` others go on. The search ends by
transformers' rules: early_stopping=True once `beam_width` hypotheses are finished, False when no
live beam can still beat the worst finished one (at its current length), "never" likewise but with
the best length a positive length penalty could reach. Beams share their prompt's KV blocks through
the prefix cache, so a step recomputes only each beam's newest token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from splitserve.engine.processor import ProcessedRequest
from splitserve.sampling_params import BeamSearchParams

_DEAD = -1.0e9  # transformers' score for a slot that must not be chosen


@dataclass
class BeamSequence:
    """A beam: its generated tokens and each one's log-probability."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    score: float = 0.0  # float32 sum of the logprobs (transformers' running beam score)
    finished: bool = False
    stopped: bool = False  # ended with a stop token (else by length)

    @property
    def cumulative_logprob(self) -> float:
        return self.score


class BeamSearch:
    """The search of one prompt. `candidates_per_beam()` says how many top tokens each live beam's
    next position must report; `step()` takes them and advances."""

    def __init__(self, prompt_len: int, params: BeamSearchParams, stop_token_ids: set[int]):
        self.params, self.prompt_len = params, prompt_len
        self.stop_ids = set() if params.ignore_eos else set(stop_token_ids)
        self.max_length = prompt_len + params.max_tokens
        self.cur_len = prompt_len
        self.live = [BeamSequence()]  # transformers' extra beams start at -1e9: only one is real
        self.finished: list[tuple[float, BeamSequence]] = []  # (length-penalised score, hypothesis)
        self.heuristic_unsatisfied = True
        self.done = False

    @property
    def candidates_per_beam(self) -> int:
        return max(2, 1 + len(self.stop_ids)) * self.params.beam_width

    def step(self, candidates: list[list[tuple[int, float]]]) -> None:
        """`candidates[i]`: the top (token, logprob) pairs of live beam i's next token, best first."""
        width, keep = self.params.beam_width, self.candidates_per_beam
        flat = [(beam, token, lp) for beam, top in enumerate(candidates) for token, lp in top]
        scores = torch.tensor([self.live[b].score for b, _, _ in flat], dtype=torch.float32)
        scores = scores + torch.tensor([lp for _, _, lp in flat], dtype=torch.float32)
        top_scores, order = torch.topk(scores, k=min(keep, len(flat)))
        chosen = [(flat[i], float(s)) for i, s in zip(order.tolist(), top_scores.tolist())]
        ends = [token in self.stop_ids or self.cur_len + 1 >= self.max_length for (_, token, _), _ in chosen]
        self._update_finished(chosen[:width], ends[:width])
        self.live = self._next_live(chosen, ends, width)
        self.cur_len += 1
        self._check_heuristic()
        self.done = self._should_stop(ends)

    def _extend(self, beam: int, token: int, lp: float, score: float, finished: bool) -> BeamSequence:
        parent = self.live[beam]
        return BeamSequence(
            parent.tokens + [token], parent.logprobs + [lp], score, finished, finished and token in self.stop_ids
        )

    def _next_live(self, chosen, ends: list[bool], width: int) -> list[BeamSequence]:
        """The best `width` candidates that did not end (transformers masks ended ones by -1e9)."""
        masked = torch.tensor([s for _, s in chosen], dtype=torch.float32)
        masked = masked + torch.tensor(ends, dtype=torch.float32) * _DEAD
        order = torch.topk(masked, k=min(width, len(chosen)))[1].tolist()
        return [self._extend(*chosen[i][0], float(masked[i]), False) for i in order if not ends[i]]

    def _update_finished(self, top, ends: list[bool]) -> None:
        """The top `width` candidates that ended join the hypotheses, if they beat the worst kept."""
        width = self.params.beam_width
        full = len(self.finished) == width and self.params.early_stopping is True
        # A Python float divides the float32 score, as in transformers.
        length = _power(self.cur_len + 1 - self.prompt_len, self.params.length_penalty)
        for ((beam, token, lp), score), ended in zip(top, ends):
            if not ended or full or not self.heuristic_unsatisfied:
                continue
            penalised = float(torch.tensor(score, dtype=torch.float32) / length)
            self.finished.append((penalised, self._extend(beam, token, lp, score, True)))
        self.finished.sort(key=lambda item: -item[0])  # stable: earlier hypotheses win ties, as topk does
        del self.finished[width:]

    def _check_heuristic(self) -> None:
        """Whether a live beam can still beat the worst finished hypothesis (transformers' rule)."""
        width, lp = self.params.beam_width, self.params.length_penalty
        if len(self.finished) < width or not self.live:
            return
        if self.params.early_stopping == "never" and lp > 0.0:
            best_length = self.max_length - self.prompt_len
        else:
            best_length = self.cur_len - self.prompt_len
        best = torch.tensor(self.live[0].score, dtype=torch.float32) / _power(best_length, lp)
        worst = min(score for score, _ in self.finished)
        self.heuristic_unsatisfied = self.heuristic_unsatisfied and float(best) > worst

    def _should_stop(self, ends: list[bool]) -> bool:
        all_finished = len(self.finished) == self.params.beam_width
        return (
            not self.heuristic_unsatisfied
            or (all_finished and self.params.early_stopping is True)
            or all(ends)
            or not self.live
        )

    def results(self, n: int) -> list[BeamSequence]:
        """The n best hypotheses, best first (live beams fill in when too few ended)."""
        ranked = [seq for _, seq in self.finished]
        return (ranked + [b for b in self.live if b not in ranked])[:n]


def top_candidates(entry: dict) -> list[tuple[int, float]]:
    """A step's (token, logprob) candidates from one position's logprobs entry, best first."""
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in entry.items() if lp.rank is not None)
    return [(token, logprob) for _, token, logprob in ranked]


def step_params(search: BeamSearch):
    """The SamplingParams that extend one beam by one token and report its candidates."""
    from splitserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=search.candidates_per_beam, ignore_eos=True, detokenize=False
    )


def _power(length: int, exponent: float) -> float:
    """length ** exponent, infinite rather than an OverflowError for an extreme length_penalty."""
    try:
        return float(length) ** exponent
    except (OverflowError, ZeroDivisionError):
        return math.inf


def beam_prompt(request: ProcessedRequest, tokens: list[int], params) -> ProcessedRequest:
    """A beam's one-token request: the processed prompt (a ProcessedRequest) with the beam's tokens
    after it, its images, where it has some, at the same places."""
    return ProcessedRequest(None, request.prompt_token_ids + tokens, params, mm_features=request.mm_features)
