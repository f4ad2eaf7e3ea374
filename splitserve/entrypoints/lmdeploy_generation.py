"""LMDeploy's `GenerationConfig`, mapped onto splitserve's SamplingParams (see lmdeploy_api.py): its
sampling fields, stop words, `response_format` as structured output, and the fields splitserve refuses;
and what comes back, LMDeploy's `Response`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from splitserve.outputs import RequestOutput
from splitserve.sampling_params import GuidedDecodingParams, SamplingParams

_DO_SAMPLE_TOP_K = 50  # LMDeploy >= 0.6's default top_k, which came with do_sample


@dataclass
class GenerationConfig:
    """LMDeploy's generation settings, turned into a `SamplingParams` by `to_sampling_params()`.

    The defaults are the pipeline document's (max_new_tokens 512, top_p 1.0, top_k 1, temperature
    0.8). Greedy or sampling: top_k=1 keeps one token, so the defaults decode greedily, and so does
    a config that sets only temperature or top_p; a top_k other than 1 samples with
    temperature/top_p/top_k/min_p, as the document's examples (top_k=40) expect. `do_sample=True`
    (LMDeploy >= 0.6) samples too; left at top_k=1 it takes that release's top_k, 50.

    Other differences from LMDeploy: `stop_words` are matched as strings in the text (cut from it
    unless `include_stop_str_in_output`), not as single tokens; `bad_token_ids` get a logit bias of
    -inf; `logprobs=k` gives, per generated token, the chosen token and the k most likely ones;
    `n` must be 1, as LMDeploy documents. `response_format` guides the output (json_object,
    json_schema, regex_schema; docs/structured_output.md).
    """

    n: int = 1
    max_new_tokens: int | None = 512
    do_sample: bool = False
    top_p: float = 1.0
    top_k: int = 1
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] | None = None
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    response_format: dict | None = None

    def is_sampling(self) -> bool:
        """Whether this config samples; see the class docstring."""
        return self.do_sample or self.top_k != 1

    def _top_k(self) -> int:
        return _DO_SAMPLE_TOP_K if self.do_sample and self.top_k == 1 else self.top_k

    def to_sampling_params(self) -> SamplingParams:
        if self.n != 1:
            raise ValueError(f"GenerationConfig.n={self.n} is not supported: as in LMDeploy, only n=1 is.")
        bad_ids = list(self.bad_token_ids or [])
        if not all(isinstance(t, int) for t in bad_ids):
            raise ValueError(f"GenerationConfig.bad_token_ids must be integers, got {self.bad_token_ids!r}.")
        return SamplingParams(
            n=1,
            max_tokens=self.max_new_tokens,
            temperature=self.temperature if self.is_sampling() else 0.0,
            top_p=self.top_p,
            top_k=self._top_k(),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            seed=self.random_seed,
            stop=self.stop_words,
            bad_words=self.bad_words,
            stop_token_ids=self.stop_token_ids,
            logit_bias={t: -math.inf for t in bad_ids} or None,
            min_tokens=self.min_new_tokens or 0,
            logprobs=self.logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            guided_decoding=_guide_from_response_format(self.response_format),
        )


def _guide_from_response_format(response_format: dict | None) -> GuidedDecodingParams | None:
    """LMDeploy's `response_format`: OpenAI's dicts (`json_object`, `json_schema` with the schema under
    json_schema.schema) plus LMDeploy's `{"type": "regex_schema", "regex_schema": "..."}`."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError(f"GenerationConfig.response_format must be a dict with a 'type', got {response_format!r}.")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if schema is None:
            raise ValueError("GenerationConfig.response_format of type json_schema needs json_schema.schema.")
        return GuidedDecodingParams(json=schema)
    if kind == "regex_schema":
        regex = response_format.get("regex_schema")
        if not isinstance(regex, str):
            raise ValueError("GenerationConfig.response_format of type regex_schema needs a regex_schema string.")
        return GuidedDecodingParams(regex=regex)
    raise ValueError(
        f"GenerationConfig.response_format type {kind!r} is not supported "
        "(text, json_object, json_schema, regex_schema are)."
    )


@dataclass
class Response:
    """One prompt's result, as LMDeploy's. From `stream_infer`, `text`, `token_ids` and `logprobs`
    hold only what is new since the previous Response of the same prompt, while
    `generate_token_len` counts every token generated so far."""

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: str | None = None  # 'stop' or 'length' once the prompt is done
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    index: int = 0  # the prompt's position in the batch


def with_stop_words(params: SamplingParams, words: list[str]) -> SamplingParams:
    """The named template's end-of-answer words added to a request's stop strings."""
    stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    return dataclasses.replace(params, stop=stop + [w for w in words if w not in stop])


def response_of(output: RequestOutput, index: int, generate_token_len: int) -> Response:
    completion = output.outputs[0]
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [{tid: lp.logprob for tid, lp in position.items()} for position in completion.logprobs]
    return Response(
        text=completion.text,
        generate_token_len=generate_token_len,
        input_token_len=len(output.prompt_token_ids),
        finish_reason=completion.finish_reason,
        token_ids=list(completion.token_ids),
        logprobs=logprobs,
        index=index,
    )
