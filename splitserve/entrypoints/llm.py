"""The vLLM-style offline API: LLM(model).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

from tqdm.auto import tqdm

from splitserve.engine.arg_utils import EngineArgs
from splitserve.engine.beam_search import BeamSearch, beam_prompt, step_params, top_candidates
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.engine.processor import ProcessedRequest, PromptType
from splitserve.lora.request import LoRARequest
from splitserve.multimodal import chat as chat_images
from splitserve.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from splitserve.pooling_params import (
    PoolingParams,
    classifier_activation,
    cosine_similarity,
    is_classifier,
    score_pairs,
)
from splitserve.sampling_params import BeamSearchParams, SamplingParams
from splitserve.tokenizer import apply_chat_template


class LLM:
    """An engine for offline batch inference.

    `model` is a Hugging Face directory, a hub id, a .gguf file, or None for the embedded default
    model (SmolLM2-135M-Instruct). Keyword arguments are vLLM's engine arguments (dtype,
    max_model_len, block_size, enable_prefix_caching, max_num_seqs, ...); unknown ones are refused.
    """

    def __init__(self, model: str | None = None, **kwargs):
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"Unknown engine arguments: {sorted(unknown)}.")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling_params (vLLM's method): SamplingParams'
        defaults with the model's generation config laid over them (generation_config="auto", the
        default; "vllm" leaves them out; loader/generation_config.py). Its max_tokens stays 16
        unless the model's config sets max_new_tokens."""
        return SamplingParams(**self.llm_engine.config.model_config.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order. `lora_request`: the
        LoRA adapter of every prompt, or one per prompt (None: the base model); needs enable_lora.
        `priority`: one per prompt, lower first (needs scheduling_policy="priority"), as vLLM's."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_list(sampling_params, len(prompts))
        loras = self._lora_list(lora_request, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts.")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        ids: list[str] = []
        try:
            for prompt, sp, lora, prio in zip(prompts, params, loras, priorities):
                ids.append(self._add(prompt, sp, lora, prio))
        except Exception:  # one bad prompt refuses the whole call; the ones before it must not linger
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            conversation, images = self._chat_images(conversation, chat_template)
            text = apply_chat_template(
                tokenizer, conversation, chat_template, add_generation_prompt, **(chat_template_kwargs or {})
            )
            if images:  # the processor tokenizes it with its images
                prompts.append(chat_images.rendered_prompt(text, images))
                continue
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _chat_images(self, conversation: list[dict], chat_template: str | None) -> tuple[list[dict], list]:
        """The conversation as the template renders it, and its images (image parts; multimodal/chat.py)."""
        template = chat_template or self.get_tokenizer().chat_template
        return chat_images.split_for_template(conversation, self.llm_engine.processor.multimodal, template)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (the pooling runner: runner="pooling", docs/pooling.md), in the
        prompts' order: `output.outputs.embedding`, pooled and normalized as the model's pooler
        config says, unless `pooling_params` (one, or one per prompt) say otherwise."""
        if self._classifier:
            raise ValueError("This is a classification model: it answers LLM.classify and LLM.score, not embeddings.")
        return self._pool(prompts, pooling_params, use_tqdm, lora_request)

    @property
    def _classifier(self) -> bool:
        return is_classifier(self.llm_engine.config.model_config.hf_config)

    def _pool(self, prompts, pooling_params, use_tqdm: bool, lora_request) -> list[EmbeddingRequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._list(pooling_params, PoolingParams, len(prompts))
        ids: list[str] = []
        try:
            for prompt, pp, lora in zip(prompts, params, self._lora_list(lora_request, len(prompts))):
                ids.append(str(next(self._counter)))
                kind = RequestOutputKind.FINAL_ONLY
                self.llm_engine.add_request(ids[-1], prompt, None, kind, lora_request=lora, pooling_params=pp)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        outputs = self._run(ids, use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.pooled), o.prompt_token_ids) for o in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """A classification model's probabilities for each prompt (vLLM's LLM.classify):
        `output.outputs.probs`, the softmax of its labels' logits (the sigmoid of a single one)."""
        if not self._classifier:
            raise ValueError("LLM.classify needs a classification model (*ForSequenceClassification).")
        return [
            ClassificationRequestOutput(
                o.request_id, ClassificationOutput(classifier_activation(o.outputs.embedding)), o.prompt_token_ids
            )
            for o in self._pool(prompts, None, use_tqdm, lora_request)
        ]

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: for an embedding model the cosine similarity of each pair's embeddings;
        for a cross-encoder (a classification model of one label) the sigmoid of its logit for the
        pair, read together. One text against one, one against many, or many against as many."""
        pairs = score_pairs(data_1, data_2)
        if self._classifier:
            processor = self.llm_engine.processor
            outputs = self.classify([processor.pair_prompt(a, b) for a, b in pairs], use_tqdm)
            if outputs and outputs[0].outputs.num_classes != 1:
                raise ValueError(
                    f"Scoring needs a cross-encoder of one label; this model has {outputs[0].outputs.num_classes}: "
                    "use LLM.classify."
                )
            return [
                ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]), o.prompt_token_ids)
                for o in outputs
            ]
        unique: dict[str, PromptType] = {}  # each text embedded once (one query against many documents)
        for pair in pairs:
            for prompt in pair:
                unique.setdefault(_prompt_key(prompt), prompt)
        embedded = dict(zip(unique, self.embed(list(unique.values()), pooling_params, use_tqdm)))
        outputs = []
        for a, b in pairs:
            first, second = embedded[_prompt_key(a)], embedded[_prompt_key(b)]
            score = cosine_similarity(first.outputs.embedding, second.outputs.embedding)
            ids = first.prompt_token_ids + second.prompt_token_ids
            outputs.append(ScoringRequestOutput(str(next(self._counter)), ScoringOutput(score), ids))
        return outputs

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search, scored and stopped as transformers' generate(num_beams=...) is
        (engine/beam_search.py). Every step extends each live beam of every prompt by one token;
        the beams' shared prefixes are prefix-cache hits. Returns each prompt's `beam_width` best
        hypotheses, best first."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        processor = engine.processor
        # Each prompt processed once (its images with it); every step runs it with a beam's tokens after.
        processed = [processor.process(p, SamplingParams(max_tokens=params.max_tokens)) for p in prompts]
        stop_ids = {processor.eos_token_id, *processor.extra_eos_ids} - {None}
        searches = [BeamSearch(len(p.prompt_token_ids), params, stop_ids) for p in processed]
        bar = tqdm(total=params.max_tokens, desc="Beam search steps", disable=not use_tqdm)
        while not all(s.done for s in searches):
            self._beam_step([(p, s) for p, s in zip(processed, searches) if not s.done])
            bar.update(1)
        bar.close()
        return [self._beam_output(p.prompt_token_ids, s, params.beam_width) for p, s in zip(processed, searches)]

    def _beam_step(self, searches: list[tuple[ProcessedRequest, BeamSearch]]) -> None:
        """One token for every live beam of the given searches, in one batch."""
        request_ids = []
        for prompt, search in searches:
            params = step_params(search)
            for beam in search.live:
                request_ids.append(self._add(beam_prompt(prompt, beam.tokens, params), params))
        outputs = iter(self._run(request_ids, use_tqdm=False))
        for _, search in searches:
            search.step([top_candidates(next(outputs).outputs[0].logprobs[0]) for _ in search.live])

    def _beam_output(self, prompt_ids: list[int], search: BeamSearch, n: int) -> BeamSearchOutput:
        tokenizer = self.get_tokenizer()
        sequences = []
        for beam in search.results(n):
            reason = "stop" if beam.stopped else "length"
            text = tokenizer.decode(beam.tokens, skip_special_tokens=True)
            sequences.append(BeamSearchSequence(prompt_ids + beam.tokens, beam.logprobs, beam.score, text, reason))
        return BeamSearchOutput(sequences)

    def _params_list(self, params, n: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * n
        return self._list(params, SamplingParams, n)

    @staticmethod
    def _list(params, kind: type, n: int) -> list:
        """One params object for every prompt, or one per prompt (None stays None)."""
        if params is None or isinstance(params, kind):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"Got {len(params)} {kind.__name__} for {n} prompts.")
        return list(params)

    @staticmethod
    def _lora_list(lora_request, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        if len(lora_request) != n:
            raise ValueError(f"Got {len(lora_request)} LoRA requests for {n} prompts.")
        return list(lora_request)

    def _add(
        self, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None = None, priority: int = 0
    ) -> str:
        request_id = str(next(self._counter))
        self.llm_engine.add_request(
            request_id, prompt, params, RequestOutputKind.FINAL_ONLY, lora_request=lora_request, priority=priority
        )
        return request_id

    # --- sleep mode (vLLM's LLM methods; engine/core/sleep_mode.py) ---------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release the KV cache and move the weights to host memory (1) or drop them (2); the engine
        must be idle, and refuses requests until wake_up()."""
        self.llm_engine.engine_core.sleeping.sleep(level)

    def wake_up(self) -> None:
        self.llm_engine.engine_core.sleeping.wake_up()

    def is_sleeping(self) -> bool:
        return self.llm_engine.engine_core.sleeping.level > 0

    def update_weights(self, model_path: str, load_format: str = "auto") -> None:
        """Load a new checkpoint of the same model (same architecture and shapes) into the idle
        engine, on every rank; the prefix cache is emptied (engine/core/weight_update.py)."""
        self.llm_engine.engine_core.sleeping.update_weights(model_path, load_format)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (after the weights changed); False while requests hold blocks."""
        return self.llm_engine.engine_core.sleeping.reset_prefix_cache()

    # --- LoRA adapters (vLLM's LLM methods) ---------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm)
        out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        out_tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{out_tokens / max(bar.format_dict['elapsed'], 1e-6):.1f} out tok/s")
        except BaseException:
            engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]


def _prompt_key(prompt: PromptType) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
