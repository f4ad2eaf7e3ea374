"""The LMDeploy-style offline API: pipeline(model, backend_config=...)(prompts, gen_config=...).

LMDeploy scripts run on splitserve's engine with only the import changed:

    from splitserve import pipeline, GenerationConfig, PytorchEngineConfig
    pipe = pipeline(model_path, backend_config=PytorchEngineConfig(session_len=2048))
    pipe(["Hi, pls intro yourself", "Shanghai is"], gen_config=GenerationConfig(max_new_tokens=64))

Both backend configs (`PytorchEngineConfig`, `TurbomindEngineConfig`) map onto the same
`EngineArgs`; a field whose feature splitserve lacks raises ValueError when set to anything but
its default, instead of being silently ignored. Only text generation is offered: LMDeploy's
`chat`, `session`, `get_ppl`, adapters and vision inputs are not.
"""
from __future__ import annotations

import gc
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields

from tqdm.auto import tqdm

from splitserve.config import resolve_device

from splitserve.engine.arg_utils import EngineArgs
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.outputs import RequestOutput
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import apply_chat_template

_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


# --- generation ------------------------------------------------------------------------------
@dataclass
class GenerationConfig:
    """LMDeploy's generation settings, turned into a `SamplingParams` by `to_sampling_params()`.

    Greedy or sampling: `do_sample=True` samples with temperature/top_p/top_k/min_p. With
    `do_sample=False` decoding is greedy, as in LMDeploy >= 0.6, UNLESS temperature, top_p or top_k
    differ from their defaults (0.8, 1.0, 50): older LMDeploy sampled whenever they were given, and
    its documented examples still pass them without do_sample, so setting them means "sample".

    Other differences from LMDeploy: `stop_words` are matched as strings in the text (cut from it
    unless `include_stop_str_in_output`), not as single tokens; `bad_token_ids` get a logit bias of
    -inf; `logprobs=k` gives, per generated token, the chosen token and the k most likely ones;
    `n` must be 1, as LMDeploy documents.
    """

    n: int = 1
    max_new_tokens: int | None = 512
    do_sample: bool = False
    top_p: float = 1.0
    top_k: int = 50
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

    def is_sampling(self) -> bool:
        """Whether this config samples; see the class docstring for the do_sample rule."""
        if self.do_sample:
            return True
        defaults = {f.name: f.default for f in fields(GenerationConfig)}
        return any(getattr(self, name) != defaults[name] for name in ("temperature", "top_p", "top_k"))

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
            top_k=self.top_k,
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
        )


@dataclass
class Response:
    """One prompt's result, as LMDeploy's. From `stream_infer`, `text`, `token_ids` and `logprobs`
    hold only what is new since the previous Response of the same prompt, while
    `generate_token_len` counts every token generated so far."""

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: str | None = None   # 'stop' or 'length' once the prompt is done
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    index: int = 0                     # the prompt's position in the batch


# --- engine configuration --------------------------------------------------------------------
def _refuse_unsupported(config, unsupported: dict[str, tuple[object, str]]) -> None:
    """Raise for the first field whose value is not its supported default: silently ignoring a
    setting would hand the user a different engine from the one asked for."""
    for name, (supported, why) in unsupported.items():
        value = getattr(config, name)
        if value != supported:
            raise ValueError(f"{type(config).__name__}.{name}={value!r} is not supported by splitserve: {why} "
                             f"Leave it at {supported!r}.")


def _check_range(config, name: str, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{type(config).__name__}.{name} must be {expected}, got {getattr(config, name)!r}.")


def _mem_available_bytes() -> int:
    """Free host memory as the kernel counts it (MemAvailable), for the CPU KV-cache budget."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise ValueError("Cannot tell how much host memory is free (no psutil, no /proc/meminfo), so "
                     "cache_max_entry_count cannot be turned into a KV-cache size: set num_gpu_blocks instead.")


def _kv_cache_kwargs(fraction: float, device: str) -> dict:
    """cache_max_entry_count is LMDeploy's share of free memory for the KV cache. On CUDA it becomes
    gpu_memory_utilization (the cache then gets free - (1 - fraction) * total bytes: the same share
    when the GPU holds nothing else). On CPU it is that share of MemAvailable, measured now, before
    the weights are loaded."""
    if resolve_device(device).type == "cuda":
        return {"gpu_memory_utilization": fraction}
    return {"kv_cache_memory_bytes": int(fraction * _mem_available_bytes())}


def _common_engine_args(config, model_path: str, block_size: int, device: str, **extra) -> EngineArgs:
    """The EngineArgs that both backend configs share; their fields have the same names here."""
    _check_range(config, "cache_max_entry_count", 0.0 < config.cache_max_entry_count <= 1.0,
                 "a fraction of free memory in (0, 1]")
    _check_range(config, "max_prefill_token_num", config.max_prefill_token_num >= 1, ">= 1")
    _check_range(config, "max_batch_size", config.max_batch_size is None or config.max_batch_size >= 1,
                 "None or >= 1")
    _check_range(config, "session_len", config.session_len is None or config.session_len >= 1, "None or >= 1")
    kwargs = dict(
        model=model_path,
        dtype=config.dtype,
        kv_cache_dtype=_kv_cache_dtype(config),
        revision=config.revision,
        max_model_len=config.session_len,
        block_size=block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        max_num_batched_tokens=config.max_prefill_token_num,
        tensor_parallel_size=config.tp,
        device=device,
        **extra,
    )
    if config.max_batch_size is not None:
        kwargs["max_num_seqs"] = config.max_batch_size
    if kwargs.get("num_gpu_blocks_override") is None:
        kwargs.update(_kv_cache_kwargs(config.cache_max_entry_count, device))
    return EngineArgs(**kwargs)


_QUANT_POLICY_KV_CACHE_DTYPES = {0: "auto", 8: "int8", 4: "int4"}


def _kv_cache_dtype(config) -> str:
    """LMDeploy's quant_policy as a kv_cache_dtype: 0 none, 8 int8, 4 int4. Like LMDeploy's, both
    quantize per token and KV head with no calibration (int8 symmetric here, int4 asymmetric)."""
    if config.quant_policy not in _QUANT_POLICY_KV_CACHE_DTYPES:
        raise ValueError(f"{type(config).__name__}.quant_policy must be 0 (no KV-cache quantization), 8 (int8 KV "
                         f"cache) or 4 (int4 KV cache), got {config.quant_policy!r}.")
    return _QUANT_POLICY_KV_CACHE_DTYPES[config.quant_policy]


_TP_WHY = "tensor parallelism is not implemented yet."
_DOWNLOAD_WHY = "models are cached where huggingface_hub puts them (set HF_HUB_CACHE to move it)."


@dataclass
class PytorchEngineConfig:
    """LMDeploy's PyTorch-backend settings; `to_engine_args()` maps them onto EngineArgs.

    session_len -> max_model_len (None: the model's maximum); max_batch_size -> max_num_seqs
    (None: splitserve's default); block_size -> block_size; num_gpu_blocks > 0 ->
    num_gpu_blocks_override; max_prefill_token_num -> max_num_batched_tokens (the step budget,
    which decodes share); cache_max_entry_count -> the KV-cache budget (see `_kv_cache_kwargs`);
    eager_mode -> enforce_eager; quant_policy 0 / 8 / 4 -> kv_cache_dtype auto / int8 / int4;
    dtype, revision, enable_prefix_caching keep their names.
    device_type 'cuda' runs on CUDA when it is there and on the CPU otherwise (refusing would
    break every LMDeploy example on a CPU machine); 'cpu' forces the CPU.
    prefill_interval is accepted (>= 1): the chunked-prefill scheduler admits waiting prompts on
    every step, which meets "a prefill at least every prefill_interval steps".
    thread_safe is accepted: a Pipeline may always be used from several threads.
    """

    dtype: str = "auto"
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float = 0.8
    prefill_interval: int = 16
    block_size: int = 64
    num_cpu_blocks: int = 0
    num_gpu_blocks: int = 0
    adapters: dict[str, str] | None = None
    max_prefill_token_num: int = 4096
    thread_safe: bool = False
    enable_prefix_caching: bool = False
    device_type: str = "cuda"
    eager_mode: bool = False
    download_dir: str | None = None
    revision: str | None = None
    quant_policy: int = 0
    eviction_type: str = "recompute"

    def to_engine_args(self, model_path: str) -> EngineArgs:
        _refuse_unsupported(self, {
            "tp": (1, _TP_WHY),
            "num_cpu_blocks": (0, "KV blocks are never swapped to host memory (preempted requests are recomputed)."),
            "eviction_type": ("recompute", "preempted requests are recomputed, never copied to host memory."),
            "adapters": (None, "LoRA adapters are not implemented yet."),
            "download_dir": (None, _DOWNLOAD_WHY),
        })
        _check_range(self, "prefill_interval", self.prefill_interval >= 1, ">= 1")
        _check_range(self, "num_gpu_blocks", self.num_gpu_blocks >= 0, ">= 0")
        return _common_engine_args(
            self, model_path, self.block_size, _device(self.device_type),
            num_gpu_blocks_override=self.num_gpu_blocks or None, enforce_eager=self.eager_mode)


# LMDeploy's model_format -> splitserve's quantization (None: as the checkpoint says)
_MODEL_FORMATS = {None: None, "hf": None, "awq": "awq", "gptq": "gptq", "fp8": "fp8"}


@dataclass
class TurbomindEngineConfig:
    """LMDeploy's TurboMind-backend settings, served by splitserve's engine like PytorchEngineConfig
    (cache_block_seq_len -> block_size; the other shared fields map the same way). The engine runs
    on CUDA when it is there and on the CPU otherwise. model_format 'awq' / 'gptq' / 'fp8' ->
    quantization (the checkpoint must be in that format; None or 'hf' take whatever the checkpoint's
    quantization_config says). TurboMind-only features (RoPE scaling and log-n attention overrides,
    the iteration knobs) are refused."""

    dtype: str = "auto"
    model_format: str | None = None
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float = 0.8
    cache_block_seq_len: int = 64
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    rope_scaling_factor: float = 0.0
    use_logn_attn: bool = False
    download_dir: str | None = None
    revision: str | None = None
    max_prefill_token_num: int = 8192
    num_tokens_per_iter: int = 0
    max_prefill_iters: int = 1

    def to_engine_args(self, model_path: str) -> EngineArgs:
        if self.model_format not in _MODEL_FORMATS:
            raise ValueError(f"TurbomindEngineConfig.model_format must be one of {sorted(_MODEL_FORMATS, key=str)}, "
                             f"got {self.model_format!r}.")
        _refuse_unsupported(self, {
            "tp": (1, _TP_WHY),
            "rope_scaling_factor": (0.0, "RoPE scaling comes from the model's config.json only."),
            "use_logn_attn": (False, "log-n attention scaling is not implemented."),
            "download_dir": (None, _DOWNLOAD_WHY),
            "num_tokens_per_iter": (0, "the step budget is max_prefill_token_num; there is no separate one."),
            "max_prefill_iters": (1, "long prompts are chunked by the step budget, not by an iteration count."),
        })
        return _common_engine_args(self, model_path, self.cache_block_seq_len, "auto",
                                   quantization=_MODEL_FORMATS[self.model_format])


def _device(device_type: str) -> str:
    """LMDeploy's device_type as an EngineArgs device; see PytorchEngineConfig for why 'cuda' is 'auto'."""
    if device_type == "cuda":
        return "auto"
    if device_type == "cpu":
        return "cpu"
    raise ValueError(f"PytorchEngineConfig.device_type={device_type!r} is not supported by splitserve: "
                     "use 'cuda' (CUDA when available, else the CPU) or 'cpu'.")


# --- prompts ---------------------------------------------------------------------------------
def _chat_template(config) -> str | None:
    """The jinja template of a chat_template_config: None, or a dict/object with a `chat_template`
    string. LMDeploy's named templates (model_name, meta_instruction, ...) are refused rather than
    dropped, since the prompts would silently change."""
    if config is None:
        return None
    if isinstance(config, dict):
        template = config.get("chat_template")
        others = sorted(k for k, v in config.items() if k != "chat_template" and v is not None)
    else:
        template, others = getattr(config, "chat_template", None), []
    if not isinstance(template, str) or others:
        raise ValueError("chat_template_config must be None or have a `chat_template` jinja string (and nothing "
                         f"else); LMDeploy's named templates are not supported. Got {config!r}.")
    return template


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

    def __init__(self, engine: LLMEngine, chat_template: str | None = None):
        self.engine: LLMEngine | None = engine
        self.tokenizer = engine.get_tokenizer()
        self.chat_template = chat_template
        self._lock = threading.Lock()
        self._queues: dict[str, deque[RequestOutput]] = {}
        self._abandoned: list[str] = []   # requests to abort once the lock is free
        self._counter = itertools.count()

    # --- public API ---
    def __call__(self, prompts, gen_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
                 do_preprocess: bool = True, adapter_name: str | None = None, use_tqdm: bool = False):
        return self.batch_infer(prompts, gen_config, do_preprocess, adapter_name, use_tqdm)

    def batch_infer(self, prompts, gen_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
                    do_preprocess: bool = True, adapter_name: str | None = None, use_tqdm: bool = False):
        """Generate for every prompt and return the finished Responses in the prompts' order."""
        single, inputs, params = self._prepare(prompts, gen_config, do_preprocess, adapter_name)
        results: list[Response | None] = [None] * len(inputs)
        with tqdm(total=len(inputs), desc="Processed prompts", unit="req", disable=not use_tqdm) as bar:
            for index, output in self._serve(inputs, params, RequestOutputKind.FINAL_ONLY):
                completion = output.outputs[0]
                results[index] = _response(output, index, len(completion.token_ids))
                bar.update(1)
        return results[0] if single else results

    def stream_infer(self, prompts, gen_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
                     do_preprocess: bool = True, adapter_name: str | None = None) -> Iterator[Response]:
        """Responses carrying what is new, as it is generated, with `index` naming the prompt; each
        prompt's last one has its finish_reason. Prompts and configs are checked now, not on the
        first `next()`. Closing the generator early aborts the prompts that are still running."""
        _, inputs, params = self._prepare(prompts, gen_config, do_preprocess, adapter_name)
        return self._stream(inputs, params)

    def close(self) -> None:
        """Abort what is running and free the model and the KV cache; the pipeline is unusable after."""
        with self._lock:
            if self.engine is None:
                return
            self.engine.abort_request(list(self._queues) + self._abandoned)
            self._queues.clear()
            self._abandoned.clear()
            device = self.engine.config.device
            self.engine = None
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- prompts and configs ---
    def _prepare(self, prompts, gen_config, do_preprocess: bool, adapter_name: str | None):
        """(single?, engine prompts, SamplingParams per prompt), with every error raised up front."""
        if adapter_name is not None:
            raise ValueError(f"adapter_name={adapter_name!r} is not supported: LoRA adapters are not implemented.")
        self._live_engine()
        single = isinstance(prompts, str) or _is_conversation(prompts)
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise ValueError("No prompts were given.")
        inputs = [self._engine_prompt(p, do_preprocess) for p in batch]
        return single, inputs, self._sampling_params(gen_config, len(batch))

    def _engine_prompt(self, prompt, do_preprocess: bool):
        """A str passes raw when do_preprocess is False (the tokenizer adds BOS, as LMDeploy's does);
        otherwise it becomes a user message. Conversations are rendered by the chat template and
        tokenized without special tokens, the template having placed them; with do_preprocess False
        their contents are joined, as LMDeploy's plain 'base' template does."""
        if isinstance(prompt, str):
            if not do_preprocess:
                return prompt
            prompt = [{"role": "user", "content": prompt}]
        if not _is_conversation(prompt):
            raise TypeError("Each prompt must be a str or a conversation (a list of {'role', 'content'} dicts); "
                            f"got {type(prompt).__name__}.")
        if not do_preprocess:
            contents = [m.get("content") for m in prompt]
            if not all(isinstance(c, str) for c in contents):
                raise ValueError("Without do_preprocess every message content must be a str.")
            return "".join(contents)
        text = apply_chat_template(self.tokenizer, list(prompt), self.chat_template)
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

    def _stream(self, inputs, params) -> Iterator[Response]:
        generated = [0] * len(inputs)
        for index, output in self._serve(inputs, params, RequestOutputKind.DELTA):
            generated[index] += len(output.outputs[0].token_ids)
            yield _response(output, index, generated[index])

    def _serve(self, inputs, params, kind: RequestOutputKind) -> Iterator[tuple[int, RequestOutput]]:
        """Add the requests, then yield (prompt index, output) until all are finished. Whatever
        ends this early (an error, a closed generator) aborts the requests that are left."""
        pending: dict[str, int] = {}
        try:
            with self._lock:
                engine = self._live_engine()
                for index, (prompt, sp) in enumerate(zip(inputs, params)):
                    request_id = str(next(self._counter))
                    engine.add_request(request_id, prompt, sp, kind)
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


def _response(output: RequestOutput, index: int, generate_token_len: int) -> Response:
    completion = output.outputs[0]
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [{tid: lp.logprob for tid, lp in position.items()} for position in completion.logprobs]
    return Response(text=completion.text, generate_token_len=generate_token_len,
                    input_token_len=len(output.prompt_token_ids), finish_reason=completion.finish_reason,
                    token_ids=list(completion.token_ids), logprobs=logprobs, index=index)


def pipeline(model_path: str, backend_config: PytorchEngineConfig | TurbomindEngineConfig | None = None,
             chat_template_config=None, log_level: str = "WARNING", **kwargs) -> Pipeline:
    """Build a Pipeline for `model_path` (a Hugging Face directory, a hub id or a .gguf file).

    backend_config None means PytorchEngineConfig(). log_level sets the `splitserve` logger's level,
    as LMDeploy sets its own. Other keyword arguments (LMDeploy's model_name, tp, ...) are refused.
    Everything is checked before the model is loaded.
    """
    if kwargs:
        raise TypeError(f"pipeline() got unsupported keyword arguments {sorted(kwargs)}; engine settings go in "
                        "backend_config.")
    if log_level not in _LOG_LEVELS:
        raise ValueError(f"log_level must be one of {_LOG_LEVELS}, got {log_level!r}.")
    chat_template = _chat_template(chat_template_config)
    if backend_config is None:
        backend_config = PytorchEngineConfig()
    if not isinstance(backend_config, (PytorchEngineConfig, TurbomindEngineConfig)):
        raise TypeError("backend_config must be a splitserve PytorchEngineConfig or TurbomindEngineConfig, "
                        f"got {type(backend_config).__name__}.")
    engine_args = backend_config.to_engine_args(model_path)
    logging.getLogger("splitserve").setLevel(log_level)
    return Pipeline(LLMEngine.from_engine_args(engine_args), chat_template)
