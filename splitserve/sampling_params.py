"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_N = 128
GUIDED_BACKENDS = ("xgrammar", "auto")  # the backends a request may name (auto: splitserve's, xgrammar)


@dataclass
class GuidedDecodingParams:
    """Structured output, as vLLM's GuidedDecodingParams (also importable as StructuredOutputsParams,
    vLLM's newer name): exactly one of `json` (a JSON schema, as a string or a dict), `regex`,
    `choice` (one of these strings), `grammar` (EBNF) or `json_object` (any JSON object). Every
    generated output then parses as that; the token mask comes from xgrammar (docs/structured_output.md)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None
    # JSON guides: True gives one-line JSON (", " and ": " between items, nothing else), False lets the
    # model put whitespace anywhere JSON allows; None: the server's --structured-outputs-config
    # (whitespace_pattern, vLLM's older field, decides when it is given).
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in _GUIDE_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "Structured output takes exactly one of json, regex, choice, grammar or json_object; "
                f"got {given or 'none'}."
            )
        if isinstance(self.json, dict):
            # A string: the grammar cache's key. Not sorted: the properties are generated in this order.
            self.json = json.dumps(self.json)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings.")
        if self.backend is not None and self.backend.split(":")[0] not in GUIDED_BACKENDS:
            raise ValueError(
                f"guided decoding backend {self.backend!r} is not available: splitserve uses xgrammar "
                f"(accepted: {', '.join(GUIDED_BACKENDS)})."
            )

    @property
    def kind(self) -> str:
        return next(name for name in _GUIDE_KINDS if getattr(self, name) not in (None, False))


_GUIDE_KINDS = ("json", "regex", "choice", "grammar", "json_object")
StructuredOutputsParams = GuidedDecodingParams


@dataclass
class StructuredOutputsConfig:
    """vLLM's --structured-outputs-config keys that splitserve has: the server's structured-output
    defaults. `disable_any_whitespace` defaults to True here (vLLM's default is False): with free
    whitespace, small models spend their token budget on newlines and spaces inside the JSON and are
    cut off by max_tokens (llama.cpp's JSON grammars likewise allow only compact whitespace)."""

    backend: str = "auto"
    disable_any_whitespace: bool = True

    @classmethod
    def from_value(cls, value: dict | str | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
        from splitserve.json_config import config_from_json

        if isinstance(value, cls):
            return value
        config = cls() if value is None else config_from_json(cls, value, "--structured-outputs-config")
        if config.backend.split(":")[0] not in GUIDED_BACKENDS:
            raise ValueError(
                f"--structured-outputs-config backend {config.backend!r} is not available: splitserve uses "
                f"xgrammar (accepted: {', '.join(GUIDED_BACKENDS)})."
            )
        if not isinstance(config.disable_any_whitespace, bool):
            raise ValueError("--structured-outputs-config disable_any_whitespace must be true or false.")
        return config

    def complete(self, guide: GuidedDecodingParams) -> GuidedDecodingParams:
        """The guide with the server's whitespace default where the request left it open (a copy)."""
        if guide.disable_any_whitespace is not None or guide.whitespace_pattern is not None:
            return guide
        from dataclasses import replace

        return replace(guide, disable_any_whitespace=self.disable_any_whitespace)


@dataclass
class SamplingParams:
    """What to generate and how: the fields and defaults of vLLM's SamplingParams.

    `top_k` of 0 or -1 means no top-k limit; `max_tokens=None` means "up to the model length".
    `stop` strings are cut from the text unless `include_stop_str_in_output`; `bad_words` are
    strings whose token sequences are never generated.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    guided_decoding: GuidedDecodingParams | None = None
    structured_outputs: GuidedDecodingParams | None = None  # vLLM's newer name for guided_decoding
    # Filled in by the engine from the tokenizer, not by users.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._merge_structured_outputs()
        self._verify()

    def _merge_structured_outputs(self) -> None:
        """One field holds the guide: `structured_outputs` is the same thing as `guided_decoding`."""
        if self.structured_outputs is not None:
            if self.guided_decoding is not None and self.guided_decoding != self.structured_outputs:
                raise ValueError("guided_decoding and structured_outputs are the same setting: give only one.")
            self.guided_decoding, self.structured_outputs = self.structured_outputs, None
        if isinstance(self.guided_decoding, dict):  # msgspec and plain callers may pass the fields
            self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)

    def _verify(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(1 <= self.n <= MAX_N, f"n must be between 1 and {MAX_N}, got {self.n}.")
        check(self.best_of is None or self.best_of >= self.n, f"best_of must be >= n ({self.n}), got {self.best_of}.")
        check(self.best_of is None or self.best_of <= MAX_N, f"best_of must be at most {MAX_N}, got {self.best_of}.")
        check(
            self.best_of is None or self.best_of == self.n or self.temperature > 0.0,
            "best_of > n needs sampling (temperature > 0): greedy samples are all alike.",
        )
        check(
            -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
        )
        check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        check(self.top_k >= 0, f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}.")
        check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}.")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).",
        )
        check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}.")
        check(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}.",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings.")
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}.")
        check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty.")

    @property
    def reads_output_history(self) -> bool:
        """Whether sampling reads the tokens generated so far (penalties, bad words, min_tokens, a
        grammar): the engine must know a request's last token before it prepares its next step."""
        return bool(
            self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.bad_words_token_ids
            or self.min_tokens
            or self.guided_decoding is not None
        )

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **changes) -> SamplingParams:
        from dataclasses import replace

        return replace(self, **changes)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (LLM.beam_search), with transformers' stopping rules."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}.")
