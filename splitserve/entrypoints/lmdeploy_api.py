"""The LMDeploy-style offline API: pipeline(model, backend_config=...)(prompts, gen_config=...).

LMDeploy scripts run on splitserve's engine with only the import changed:

    from splitserve import pipeline, GenerationConfig, PytorchEngineConfig
    pipe = pipeline(model_path, backend_config=PytorchEngineConfig(session_len=2048))
    pipe(["Hi, pls intro yourself", "Shanghai is"], gen_config=GenerationConfig(max_new_tokens=64))

Both backend configs (`PytorchEngineConfig`, `TurbomindEngineConfig`) map onto the same
`EngineArgs`; a field whose feature splitserve lacks raises ValueError when set to anything but
its default, instead of being silently ignored. Text generation, with LoRA adapters
(`PytorchEngineConfig(adapters=...)`, `adapter_name=`), and images for vision-language models
(`pipe((prompt, image))`, image_url parts in conversations) are offered: LMDeploy's `chat`, `session`
and `get_ppl` are not.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
from collections import deque
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.entrypoints.lmdeploy_chat_template import (
    ChatTemplateConfig as ChatTemplateConfig,  # part of the LMDeploy-style API (splitserve.ChatTemplateConfig)
)
from splitserve.entrypoints.lmdeploy_chat_template import (
    NamedChatTemplate,
    resolve_chat_template,
    template_by_model_name,
)
from splitserve.entrypoints.lmdeploy_config import PytorchEngineConfig, TurbomindEngineConfig
from splitserve.entrypoints.lmdeploy_generation import GenerationConfig, Response, response_of, with_stop_words
from splitserve.entrypoints.lmdeploy_legacy import gen_config_from_call
from splitserve.multimodal import chat
from splitserve.outputs import RequestOutput
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import apply_chat_template

_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


# --- prompts ---------------------------------------------------------------------------------
def _is_conversation(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


# --- the pipeline ----------------------------------------------------------------------------
class Pipeline:
    """LMDeploy's pipeline object over one LLMEngine: call it, `batch_infer`, or `stream_infer`.

    Prompts are a str, a list of str, one conversation (a list of {"role", "content"} dicts) or a
    list of conversations; a single str or conversation gives a single Response, a list gives a list.
    Calls from several threads, and several `stream_infer` generators consumed in turn, share the
    engine's batches: whoever steps the engine files each output under its request, and each caller
    takes its own.
    """

    def __init__(
        self, engine: LLMEngine, chat_template: str | NamedChatTemplate | None = None, model_path: str | None = None
    ):
        self.engine: LLMEngine | None = engine
        self.tokenizer = engine.get_tokenizer()
        if chat_template is None and model_path and getattr(self.tokenizer, "chat_template", None) is None:
            chat_template = template_by_model_name(model_path)
        self.chat_template = chat_template
        self._lock = threading.Lock()
        self._queues: dict[str, deque[RequestOutput]] = {}
        self._abandoned: list[str] = []  # requests to abort once the lock is free
        self._counter = itertools.count()

    # --- public API ---
    def __call__(
        self,
        prompts,
        gen_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        do_preprocess: bool = True,
        adapter_name: str | None = None,
        use_tqdm: bool = False,
        **legacy,
    ):
        return self.batch_infer(prompts, gen_config, do_preprocess, adapter_name, use_tqdm, **legacy)

    def batch_infer(
        self,
        prompts,
        gen_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        do_preprocess: bool = True,
        adapter_name: str | None = None,
        use_tqdm: bool = False,
        **legacy,
    ):
        """Generate for every prompt and return the finished Responses in the prompts' order.
        `legacy`: LMDeploy's deprecated request_output_len, top_k, top_p, temperature,
        repetition_penalty and ignore_eos, instead of gen_config."""
        gen_config = gen_config_from_call(gen_config, legacy)
        single, inputs, params, lora = self._prepare(prompts, gen_config, do_preprocess, adapter_name)
        results: list[Response | None] = [None] * len(inputs)
        with tqdm(total=len(inputs), desc="Processed prompts", unit="req", disable=not use_tqdm) as bar:
            for index, output in self._serve(inputs, params, RequestOutputKind.FINAL_ONLY, lora):
                completion = output.outputs[0]
                results[index] = response_of(output, index, len(completion.token_ids))
                bar.update(1)
        return results[0] if single else results

    def stream_infer(
        self,
        prompts,
        gen_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        do_preprocess: bool = True,
        adapter_name: str | None = None,
        **legacy,
    ) -> Iterator[Response]:
        """Responses carrying what is new, as it is generated, with `index` naming the prompt; each
        prompt's last one has its finish_reason. Prompts and configs are checked now, not on the
        first `next()`. Closing the generator early aborts the prompts that are still running."""
        gen_config = gen_config_from_call(gen_config, legacy)
        _, inputs, params, lora = self._prepare(prompts, gen_config, do_preprocess, adapter_name)
        return self._stream(inputs, params, lora)

    def close(self) -> None:
        """Abort what is running and free the model and the KV cache; the pipeline is unusable after."""
        with self._lock:
            if self.engine is None:
                return
            self.engine.abort_request(list(self._queues) + self._abandoned)
            self._queues.clear()
            self._abandoned.clear()
            device = self.engine.config.device
            self.engine.shutdown()
            self.engine = None
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- prompts and configs ---
    def _prepare(self, prompts, gen_config, do_preprocess: bool, adapter_name: str | None):
        """(single?, engine prompts, SamplingParams per prompt, the LoRA adapter), with every error
        raised up front."""
        engine = self._live_engine()
        lora = None
        if adapter_name is not None:
            loras = engine.engine_core.loras
            lora = loras.by_name(adapter_name) if loras.enabled else None
            if lora is None:
                known = sorted(lora.lora_name for lora in loras.list()) if loras.enabled else []
                raise ValueError(
                    f"adapter_name={adapter_name!r} is not one of this pipeline's adapters "
                    f"({', '.join(known) or 'none: give PytorchEngineConfig(adapters={name: path})'})."
                )
        single = isinstance(prompts, str) or _is_conversation(prompts) or chat.is_image_prompt(prompts)
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise ValueError("No prompts were given.")
        inputs = [self._engine_prompt(p, do_preprocess) for p in batch]
        params = self._sampling_params(gen_config, len(batch))
        if isinstance(self.chat_template, NamedChatTemplate) and self.chat_template.stop_words and do_preprocess:
            params = [with_stop_words(p, self.chat_template.stop_words) for p in params]
        return single, inputs, params, lora

    def _engine_prompt(self, prompt, do_preprocess: bool):
        """A str passes raw when do_preprocess is False (the tokenizer adds BOS, as LMDeploy's does);
        otherwise it becomes a user message. Conversations are rendered by the chat template and
        tokenized without special tokens, the template having placed them; with do_preprocess False
        their contents are joined, as LMDeploy's plain 'base' template does."""
        if chat.is_image_prompt(prompt):
            prompt = chat.image_prompt_messages(*prompt)
        if isinstance(prompt, str):
            if not do_preprocess:
                return prompt
            prompt = [{"role": "user", "content": prompt}]
        if not _is_conversation(prompt):
            raise TypeError(
                "Each prompt must be a str or a conversation (a list of {'role', 'content'} dicts); "
                f"got {type(prompt).__name__}."
            )
        if not do_preprocess:
            contents = [m.get("content") for m in prompt]
            if not all(isinstance(c, str) for c in contents):
                raise ValueError("Without do_preprocess every message content must be a str.")
            return "".join(contents)
        named = isinstance(self.chat_template, NamedChatTemplate)  # LMDeploy's own: string contents
        template = None if named else self.chat_template or self.tokenizer.chat_template
        prompt, images = chat.split_for_template(list(prompt), self.engine.processor.multimodal, template)
        if named:
            text = self.chat_template.render(prompt)
        else:
            text = apply_chat_template(self.tokenizer, prompt, self.chat_template)
        if images:
            return chat.rendered_prompt(text, images)
        return {"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids}

    @staticmethod
    def _sampling_params(gen_config, n: int) -> list[SamplingParams]:
        if gen_config is None:
            gen_config = GenerationConfig()
        if isinstance(gen_config, GenerationConfig):
            return [gen_config.to_sampling_params()] * n
        configs = list(gen_config)
        if len(configs) != n:
            raise ValueError(f"Got {len(configs)} GenerationConfigs for {n} prompts.")
        if not all(isinstance(c, GenerationConfig) for c in configs):
            raise TypeError("gen_config must be a GenerationConfig or a list of them.")
        return [c.to_sampling_params() for c in configs]

    # --- serving ---
    def _live_engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("This pipeline is closed.")
        return self.engine

    def _stream(self, inputs, params, lora) -> Iterator[Response]:
        generated = [0] * len(inputs)
        for index, output in self._serve(inputs, params, RequestOutputKind.DELTA, lora):
            generated[index] += len(output.outputs[0].token_ids)
            yield response_of(output, index, generated[index])

    def _serve(self, inputs, params, kind: RequestOutputKind, lora=None) -> Iterator[tuple[int, RequestOutput]]:
        """Add the requests, then yield (prompt index, output) until all are finished. Whatever
        ends this early (an error, a closed generator) aborts the requests that are left."""
        pending: dict[str, int] = {}
        try:
            with self._lock:
                engine = self._live_engine()
                for index, (prompt, sp) in enumerate(zip(inputs, params)):
                    request_id = str(next(self._counter))
                    engine.add_request(request_id, prompt, sp, kind, lora_request=lora)
                    self._queues[request_id] = deque()
                    pending[request_id] = index
            while pending:
                for output in self._take(pending):
                    index = pending[output.request_id]
                    if output.finished:
                        del pending[output.request_id]
                    yield index, output
        finally:
            self._forget(pending)

    def _take(self, request_ids) -> list[RequestOutput]:
        """The outputs filed for these requests, stepping the engine until there is one."""
        with self._lock:
            while True:
                engine = self._live_engine()  # close() from another thread ends every caller here
                self._abort_abandoned()
                ready = []
                for request_id in request_ids:
                    queue = self._queues[request_id]
                    if queue and queue[-1].finished:
                        del self._queues[request_id]
                    ready.extend(queue)
                    queue.clear()
                if ready:
                    return ready
                if not engine.has_unfinished_requests():
                    raise RuntimeError("The engine has no requests left but some outputs never came.")
                for output in engine.step():
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.append(output)

    def _forget(self, request_ids) -> None:
        """Abort requests whose caller has gone. Never waits for the lock: the garbage collector may
        finalize an abandoned generator in this very thread while it holds the lock (waiting would
        deadlock), so a busy lock leaves the work to whoever holds it next."""
        self._abandoned.extend(request_ids)
        if self._lock.acquire(blocking=False):
            try:
                self._abort_abandoned()
            finally:
                self._lock.release()

    def _abort_abandoned(self) -> None:
        """With the lock held: abort and drop the requests that `_forget` left."""
        request_ids = []
        while self._abandoned:
            request_ids.append(self._abandoned.pop())
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        if self.engine is not None and request_ids:
            self.engine.abort_request(request_ids)


def pipeline(
    model_path: str,
    backend_config: PytorchEngineConfig | TurbomindEngineConfig | None = None,
    chat_template_config=None,
    log_level: str = "ERROR",
    model_name: str | None = None,
    trust_remote_code: bool = True,
    **kwargs,
) -> Pipeline:
    """Build a Pipeline for `model_path` (a Hugging Face directory, a hub id or a .gguf file).

    backend_config None means TurbomindEngineConfig(), as the document says ("runs the turbomind
    backend by default"; both are served by splitserve's engine). log_level defaults to 'ERROR' as
    in the document. `model_name` (here or on the backend config)
    names LMDeploy's chat template for the model (lmdeploy_chat_template.py); chat_template_config
    overrides it; without either, the tokenizer's own template, or for a tokenizer without one
    the LMDeploy template the model's name matches (`internlm/internlm-chat-7b` -> internlm).
    trust_remote_code (True, as LMDeploy reads checkpoints) lets a checkpoint's own tokenizer code
    run (InternLM's); splitserve reads the configs of InternLM's remote-code models itself.
    log_level sets the `splitserve` logger's level, as LMDeploy sets its own. Other
    keyword arguments (LMDeploy's tp, ...) are refused. Everything is checked before the model is loaded.
    """
    if kwargs:
        raise TypeError(
            f"pipeline() got unsupported keyword arguments {sorted(kwargs)}; engine settings go in backend_config."
        )
    if log_level not in _LOG_LEVELS:
        raise ValueError(f"log_level must be one of {_LOG_LEVELS}, got {log_level!r}.")
    if backend_config is None:
        backend_config = TurbomindEngineConfig()
    if not isinstance(backend_config, (PytorchEngineConfig, TurbomindEngineConfig)):
        raise TypeError(
            "backend_config must be a splitserve PytorchEngineConfig or TurbomindEngineConfig, "
            f"got {type(backend_config).__name__}."
        )
    if model_name and backend_config.model_name and model_name != backend_config.model_name:
        raise ValueError(
            f"pipeline(model_name={model_name!r}) and the backend config's model_name "
            f"{backend_config.model_name!r} differ; give one."
        )
    chat_template = resolve_chat_template(chat_template_config, model_name or backend_config.model_name)
    engine_args = backend_config.to_engine_args(model_path)
    engine_args.trust_remote_code = trust_remote_code
    logging.getLogger("splitserve").setLevel(log_level)
    return Pipeline(LLMEngine.from_engine_args(engine_args), chat_template, model_path)
