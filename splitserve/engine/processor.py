"""Input processing: prompts (text or token ids) and sampling parameters -> validated core Requests."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from splitserve.config import ModelConfig
from splitserve.engine.messages import EngineCoreRequest
from splitserve.sampling_params import SamplingParams

PromptType = str | Mapping  # "text", {"prompt": "text"} or {"prompt_token_ids": [...]}


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


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

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, self.tokenizer(prompt).input_ids)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            return ProcessedPrompt(prompt.get("prompt"), ids)
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return self.process_prompt(prompt["prompt"])
        raise TypeError(f"A prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
                        f"got {type(prompt).__name__}.")

    def validate_prompt(self, ids: list[int]) -> None:
        max_len = self.model_config.max_model_len
        if not ids:
            raise ValueError("The prompt is empty: it must have at least one token.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Prompt token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1}).")
        if len(ids) >= max_len:
            raise ValueError(f"The prompt is {len(ids)} tokens long; the maximum model length is {max_len}, "
                             "which leaves no room for a generated token.")

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """A copy completed with what depends on the tokenizer: stop token ids and bad words."""
        params = params.clone()
        for token in list(params.logit_bias or {}) + list(params.allowed_token_ids or []):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"Token id {token} in logit_bias/allowed_token_ids is outside the vocabulary "
                                 f"(0..{self.vocab_size - 1}).")
        if not params.ignore_eos:
            params.stop_token_ids = sorted(set(params.stop_token_ids) | self.extra_eos_ids)
        params.bad_words_token_ids = self._bad_words_ids(params.bad_words)
        return params

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        out = []
        for word in words:
            # The word both at the start of a text and after a space tokenizes differently.
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer(variant, add_special_tokens=False).input_ids
                # A sequence with ids past the model's vocabulary can never be generated anyway.
                if ids and ids not in out and max(ids) < self.vocab_size:
                    out.append(ids)
        return out

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     arrival_time: float, kv_transfer=None) -> EngineCoreRequest:
        room = self.model_config.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return EngineCoreRequest(request_id, prompt_token_ids, params, self.eos_token_id, max_tokens, arrival_time,
                                 kv_transfer)


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
