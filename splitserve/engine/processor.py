"""Input processing: prompts (text or token ids) and sampling parameters -> validated core Requests.

Every front-end processes a request here, once: the prompt is tokenized and checked against the
vocabulary and the context, the params are checked against the vocabulary and completed with what
depends on the tokenizer. What the caller got wrong raises InvalidRequestError.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from splitserve.config import ModelConfig
from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.messages import EngineCoreRequest
from splitserve.pooling_params import PoolingParams, is_classifier
from splitserve.sampling_params import SamplingParams

PromptType = str | Mapping  # "text", {"prompt": "text"} or {"prompt_token_ids": [...]}


@dataclass
class ProcessedRequest:
    """A prompt and its params as the Processor left them: tokenized, validated, completed."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    pooling: PoolingParams | None = None  # a pooling request (params then asks for its one ignored token)
    client_request_id: str | None = None  # the id its client gave (X-Request-Id, request_id), set by the server
    mm_features: list = field(default_factory=list)  # its images (multimodal/inputs.py MultiModalFeature)


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        if model_config.substitute_tokenizer:  # a stand-in tokenizer's special ids mean nothing to the model
            config_eos = _config_eos_ids(model_config)
            self.eos_token_id = config_eos[0] if config_eos else None
            self.extra_eos_ids = set(config_eos[1:])
        else:
            self.eos_token_id = tokenizer.eos_token_id
            self.extra_eos_ids = _generation_config_eos_ids(model_config) - {self.eos_token_id}
        self._guides = None  # structured output's GuideCompiler, made on the first guided request
        self.multimodal = None  # a vision-language model's MultiModalProcessor (multimodal/processing.py)
        if model_config.is_multimodal:
            from splitserve.multimodal.processing import MultiModalProcessor

            self.multimodal = MultiModalProcessor(model_config, tokenizer, model_config.limit_mm_per_prompt)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def pair_prompt(self, first: PromptType, second: PromptType) -> dict:
        """A cross-encoder's input for a (query, document) pair: two texts encoded as the tokenizer
        encodes a pair (its separators and special tokens, as transformers' `tokenizer(a, b)`);
        token ids (or a text with ids) joined as they are, the second side without special tokens."""
        if isinstance(first, str) and isinstance(second, str):
            return {"prompt_token_ids": self.tokenizer(first, second).input_ids}
        return {"prompt_token_ids": self._tokenized(first, True)[1] + self._tokenized(second, False)[1]}

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedRequest:
        """One request of the offline API; a max_tokens past the context is clamped to the room left."""
        return self.process_prompt(prompt, self.process_params(params))

    def process_pooling(
        self, prompt: PromptType, pooling: PoolingParams | None, *, add_special_tokens: bool = True, param="input"
    ) -> ProcessedRequest:
        """A pooling request (the pooling runner only): the prompt checked, the params completed
        from the model's pooler config. It runs as a one-token request whose token is never shown."""
        pooler = self.model_config.pooler_config
        if pooler is None:
            raise InvalidRequestError(
                "This model runs the generate runner, which makes no embeddings: start it with --runner pooling."
            )
        pooling = (pooling or PoolingParams()).clone()
        pooling.pooling_type = pooler.pooling_type
        if pooling.normalize is None:
            pooling.normalize = pooler.normalize
        if pooling.dimensions is not None and is_classifier(self.model_config.hf_config):
            raise InvalidRequestError(
                "A classification model answers its labels' scores, not an embedding: dimensions cannot be set.",
                "dimensions",
            )
        if pooling.dimensions is not None:
            why = pooler.allows_dimensions(pooling.dimensions, self.model_config.hf_text_config.hidden_size)
            if why is not None:
                raise InvalidRequestError(why, "dimensions")
        text, ids = self._tokenized(prompt, add_special_tokens)
        self._check_prompt(ids, param)
        if len(ids) >= self.model_config.max_model_len:
            raise InvalidRequestError(
                f"The input is {len(ids)} tokens long; this model takes at most "
                f"{self.model_config.max_model_len - 1} (max_model_len {self.model_config.max_model_len}).",
                param,
            )
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        return ProcessedRequest(text, ids, params, pooling)

    def _check_generate(self) -> None:
        if self.model_config.runner_type == "pooling":
            raise InvalidRequestError(
                "This model runs the pooling runner: it answers embeddings (LLM.embed, /v1/embeddings), "
                "score and rerank, not generation. Start it with --runner generate to generate."
            )

    def process_params(self, params: SamplingParams) -> SamplingParams:
        """A copy completed with what depends on the tokenizer: stop token ids and bad words."""
        self._check_generate()
        params = params.clone()
        for token in list(params.logit_bias or {}) + list(params.allowed_token_ids or []):
            if not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"Token id {token} in logit_bias/allowed_token_ids is outside the "
                    f"vocabulary (0..{self.vocab_size - 1})."
                )
        for token in params.stop_token_ids:
            if not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"Token id {token} in stop_token_ids is outside the vocabulary (0..{self.vocab_size - 1}).",
                    "stop_token_ids",
                )
        if not params.ignore_eos:
            params.stop_token_ids = sorted(set(params.stop_token_ids) | self.extra_eos_ids)
        params.bad_words_token_ids = self._bad_words_ids(params.bad_words)
        if params.guided_decoding is not None:
            params.guided_decoding = self.model_config.structured_outputs_config.complete(params.guided_decoding)
            self._check_guide(params)
        return params

    @property
    def guides(self):
        """Structured output's GuideCompiler for this tokenizer and vocabulary, made on first use."""
        if self._guides is None:
            from splitserve.engine.core.structured_output import GuideCompiler

            self._guides = GuideCompiler(self.tokenizer, self.vocab_size)
        return self._guides

    def _check_guide(self, params: SamplingParams) -> None:
        """Compile the guide here (cached), so that one that cannot be compiled is the caller's error
        now rather than the engine's later."""
        try:
            self.guides.compile(params.guided_decoding)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "guided_decoding") from None

    def process_prompt(
        self,
        prompt: PromptType,
        params: SamplingParams,
        *,
        add_special_tokens: bool = True,
        param: str = "prompt",
        max_tokens_must_fit: bool = False,
    ) -> ProcessedRequest:
        """Tokenize and validate a prompt for `params` (as process_params left them, so that a batch
        of prompts shares one processing of its params). `param` names the prompt in errors;
        `max_tokens_must_fit` is the API server's rule: prompt + max_tokens must fit the context."""
        text, ids, features = self._inputs(prompt, add_special_tokens, param)
        self._check_prompt(ids, param)
        if max_tokens_must_fit:
            self._check_context(len(ids), params.max_tokens, param)
        else:
            self._check_room(len(ids), param)
        return ProcessedRequest(text, ids, params, mm_features=features)

    def _inputs(self, prompt: PromptType, add_special_tokens: bool, param: str) -> tuple[str | None, list[int], list]:
        """(text, token ids, images as MultiModalFeatures) of a prompt, with or without multi_modal_data."""
        if isinstance(prompt, Mapping) and prompt.get("mm_placements") is not None:
            return self._placed_inputs(prompt, param)
        if not (isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None):
            text, ids = self._tokenized(prompt, add_special_tokens)
            if self.multimodal is not None:
                self._checked(self.multimodal.check_image_tokens, param, ids)
            return text, ids, []
        if self.multimodal is None:
            raise InvalidRequestError(
                f"{self.model_config.architecture or 'This model'} has no vision encoder: it takes no images.", param
            )
        if not isinstance(prompt.get("prompt"), str) or "prompt_token_ids" in prompt:
            raise InvalidRequestError(
                "A prompt with images is a text with one image placeholder per image, as {'prompt': text, "
                "'multi_modal_data': {'image': ...}}; token ids are not taken with images.",
                param,
            )
        from splitserve.multimodal.processing import images_of

        images = self._checked(images_of, param, prompt["multi_modal_data"])
        add_special_tokens = prompt.get("add_special_tokens", add_special_tokens)  # False: a rendered chat
        ids, features = self._checked(self.multimodal.process, param, prompt["prompt"], images, add_special_tokens)
        return prompt["prompt"], ids, features

    def _placed_inputs(self, prompt: Mapping, param: str) -> tuple[str | None, list[int], list]:
        """A PD decode instance's prompt: token ids and where its images lie (their pixels stayed with
        the prefill instance, which encoded them; multimodal/inputs.py placement)."""
        if self.multimodal is None:
            raise InvalidRequestError("This model has no vision encoder: it takes no image placements.", param)
        text, ids = self._tokenized({"prompt_token_ids": prompt["prompt_token_ids"]}, False)
        return text, ids, self._checked(self.multimodal.placed_features, param, ids, prompt["mm_placements"])

    @staticmethod
    def _checked(function, param: str, *args):
        """function(*args), its ValueError (bad images, placeholders that do not match) the caller's."""
        try:
            return function(*args)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param) from None

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        kv_transfer=None,
        lora_request=None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        client_request_id: str | None = None,
        mm_features: list | None = None,
    ) -> EngineCoreRequest:
        room = self.model_config.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return EngineCoreRequest(
            request_id,
            prompt_token_ids,
            params,
            self.eos_token_id,
            max_tokens,
            arrival_time,
            kv_transfer,
            lora_request,
            priority,
            pooling,
            client_request_id,
            mm_features or [],
        )

    def _tokenized(self, prompt: PromptType, add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt, add_special_tokens)
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
            raise InvalidRequestError("Images are not taken here: only generation requests take multi_modal_data.")
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return self._tokenized(prompt["prompt"], add_special_tokens)
        raise TypeError(
            f"A prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
            f"got {type(prompt).__name__}."
        )

    def _check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise InvalidRequestError("The prompt is empty: it must have at least one token.", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"Prompt token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1}).", param
            )

    def _check_room(self, n: int, param: str) -> None:
        """The prompt must leave room for one generated token; make_request clamps max_tokens to the rest."""
        max_len = self.model_config.max_model_len
        if n >= max_len:
            raise InvalidRequestError(
                f"The prompt is {n} tokens long; the maximum model length is {max_len}, "
                "which leaves no room for a generated token.",
                param,
            )

    def _check_context(self, n: int, max_tokens: int | None, param: str) -> None:
        """The API server's rule, in OpenAI's words: clients match "maximum context length" to tell
        a context overflow from other errors."""
        max_len = self.model_config.max_model_len
        if n >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens, but the prompt "
                f"has {n} tokens, leaving no room for output.",
                param,
            )
        if max_tokens is not None and n + max_tokens > max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the "
                "completion). Reduce the prompt or max_tokens.",
                "max_tokens",
            )

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        out = []
        for word in words:
            # The word both at the start of a text and after a space tokenizes differently.
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenize(variant, add_special_tokens=False)
                # A sequence with ids past the model's vocabulary can never be generated anyway.
                if ids and ids not in out and max(ids) < self.vocab_size:
                    out.append(ids)
        return out


def _generation_config_eos_ids(model_config: ModelConfig) -> set[int]:
    """Extra end-of-sequence ids from generation_config.json (Llama 3 lists several)."""
    from transformers import GenerationConfig

    if model_config.gguf_file is not None or not os.path.isdir(model_config.model):
        return set()  # a .gguf file, or a built-in config of a dummy-weight model: no generation_config.json
    try:
        gen = GenerationConfig.from_pretrained(model_config.model)
    except OSError:
        return set()
    eos = gen.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _config_eos_ids(model_config: ModelConfig) -> list[int]:
    """The end-of-sequence ids the model's config.json names (Llama 3 Instruct lists several)."""
    eos = getattr(model_config.hf_config, "eos_token_id", None)
    return list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
