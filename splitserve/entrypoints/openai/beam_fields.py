"""The request fields of beam search and best_of, with the rules of the Ascend deployment guide and
vLLM: `use_beam_search` (beam width `best_of`, or `n`; `n` sequences returned) needs n > 1 or
best_of > 1, top_p 1, top_k -1 (or 0) and temperature 0; `length_penalty` and `early_stopping`
apply to beam search only (their defaults are accepted anywhere). Without beam search, `best_of` >
`n` draws best_of samples and returns the n with the highest cumulative logprob."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from splitserve.entrypoints.openai.request_model import ParameterError, RequestModel
from splitserve.sampling_params import MAX_N, BeamSearchParams


class BeamSearchRequestFields(RequestModel):
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _check_beam_search(self) -> BeamSearchRequestFields:
        if self.best_of is not None and self.best_of < self.n:
            raise ParameterError("best_of", f"best_of ({self.best_of}) must be at least n ({self.n}).")
        if self.use_beam_search:
            self._check_beam_constraints()
        else:
            self._check_sampling_best_of()
        return self

    def _check_beam_constraints(self) -> None:
        rules = [
            ("best_of", max(self.best_of or 1, self.n) > 1, "n > 1 or best_of > 1 (the beam width)"),
            ("top_p", self.top_p == 1.0, "top_p = 1.0"),
            ("top_k", self.top_k in (0, -1), "top_k = -1"),
            ("temperature", self.temperature in (None, 0.0), "temperature = 0.0"),
        ]
        for param, ok, rule in rules:
            if not ok:
                raise ParameterError(param, f"use_beam_search needs {rule}.")

    def _check_sampling_best_of(self) -> None:
        if self.length_penalty != 1.0:
            raise ParameterError("length_penalty", "length_penalty applies to beam search: set use_beam_search.")
        if self.early_stopping is not False:
            raise ParameterError("early_stopping", "early_stopping applies to beam search: set use_beam_search.")
        if self.best_of is not None and self.best_of > self.n:
            if self.temperature == 0.0:
                raise ParameterError(
                    "best_of", "best_of > n needs sampling (temperature > 0): greedy samples are alike."
                )
            if self.stream:
                raise ParameterError(
                    "best_of", "best_of > n cannot stream: the best samples are known only at the end."
                )

    @property
    def beam_width(self) -> int:
        return max(self.best_of or 1, self.n)

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        return BeamSearchParams(
            beam_width=self.beam_width,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
