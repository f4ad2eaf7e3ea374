"""`speculative_config`: which proposer drafts tokens and how many, with vLLM's keys."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.json_config import config_from_json

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """`method`: ngram (prompt lookup over the request's own tokens), suffix (suffix trees over the
    request and recent requests) or draft_model (a smaller model sharing the tokenizer; implied by
    `model`). `num_speculative_tokens`: the most drafts verified per step (1-16). Speculation stops
    while `disable_by_batch_size` or more requests run."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None  # draft_model: a path, hub id or .gguf file splitserve can load
    quantization: str | None = None  # draft_model: as --quantization, for the draft
    dtype: str | None = None  # draft_model: None takes the target's dtype
    load_format: str | None = None  # draft_model: None takes the target's load_format
    disable_by_batch_size: int | None = None
    prompt_lookup_max: int | None = None  # ngram: longest n-gram matched (default 5)
    prompt_lookup_min: int | None = None  # ngram: shortest n-gram matched (default 2)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a dict, a JSON string (--speculative-config) or a SpeculativeConfig; unknown keys
        are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        config = config_from_json(cls, value, "speculative_config")
        config.verify()
        return config

    def verify(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model else None
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)} (or a draft 'model'), "
                f"got {self.method!r}."
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs a 'model' (the draft model's path or id).")
        if self.method != "draft_model" and self.model:
            raise ValueError(f"speculative_config method {self.method!r} takes no 'model'.")
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("speculative_config needs num_speculative_tokens (1 to 16).")
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}."
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}.")
        self._verify_ngram()
        self._verify_suffix()

    def _verify_ngram(self) -> None:
        if self.method != "ngram":
            return
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = max(5, self.prompt_lookup_min or 0)
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = min(2, self.prompt_lookup_max)
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max ({self.prompt_lookup_max}) "
                "must satisfy 1 <= min <= max."
            )

    def _verify_suffix(self) -> None:
        if self.method != "suffix":
            return
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1 and max_cached_requests >= 0.")
        if self.suffix_decoding_max_spec_factor <= 0 or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_max_spec_factor must be > 0 and min_token_prob in [0, 1].")

    def describe(self) -> str:
        what = f"draft model {self.model}" if self.method == "draft_model" else self.method
        return f"{what}, up to {self.num_speculative_tokens} draft tokens per step"
