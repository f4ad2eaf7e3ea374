"""A request's default sampling, taken from the model's generation config (vLLM's
`--generation-config auto|vllm|PATH` and `--override-generation-config`).

- `auto` (the default): what the model's authors recommend, from the first of
  - `generation_config.json` next to a Hugging Face checkpoint,
  - the `general.sampling.*` keys of a .gguf file (llama.cpp writes them),
  - the file splitserve carries for the embedded default model (known_configs/generation/),
  whichever the model has;
- `vllm`: none of them: a request's unset fields take SamplingParams' own defaults (temperature 1.0 ...);
- a directory: its `generation_config.json`, which must exist.

Only the fields a file sets are taken (temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as max_tokens); `--override-generation-config` (generation-config keys, as JSON) is
laid over them in every mode. A request's own fields always win: these fill only what it leaves unset.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger("splitserve.generation_config")

GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a directory holding generation_config.json

# generation_config.json key -> SamplingParams field
_HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF metadata key (llama.cpp's general.sampling.*) -> SamplingParams field
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_BUILTIN_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "known_configs", "generation")


def check_generation_config(mode: str) -> None:
    """Refuse a --generation-config that is neither a mode nor a directory with the file."""
    if mode in GENERATION_CONFIG_MODES:
        return
    if not os.path.isfile(os.path.join(mode, "generation_config.json")):
        raise ValueError(
            f"--generation-config must be 'auto', 'vllm' or a directory holding generation_config.json; "
            f"{mode!r} is none of them."
        )


def sampling_defaults(model_config) -> dict[str, Any]:
    """SamplingParams field -> the value a request gets when it leaves that field unset."""
    mode = model_config.generation_config
    check_generation_config(mode)
    if mode == "vllm":
        found: dict[str, Any] = {}
    elif mode == "auto":
        found = _model_defaults(model_config)
    else:
        found = _from_json_file(os.path.join(mode, "generation_config.json"))
    found.update(_translate(model_config.override_generation_config or {}, "--override-generation-config"))
    _check_values(found)
    return found


def describe(defaults: dict[str, Any]) -> str:
    """The defaults in words, for the start-up log."""
    if not defaults:
        return "none from the model: a request's unset sampling fields take splitserve's defaults"
    fields = ", ".join(f"{name}={value}" for name, value in sorted(defaults.items()))
    return f"{fields} (where a request leaves them unset; --generation-config vllm turns them off)"


def _model_defaults(model_config) -> dict[str, Any]:
    path = model_config.model
    if os.path.isdir(path):
        file = os.path.join(path, "generation_config.json")
        return _from_json_file(file) if os.path.isfile(file) else {}
    if path.endswith(".gguf") and os.path.isfile(path):
        found = _from_gguf(path)
        builtin = _builtin_file(path)
        if not found and builtin is not None:
            found = _from_json_file(builtin)
        return found
    return {}


def _builtin_file(gguf_path: str) -> str | None:
    """The generation config splitserve carries for the embedded default model's .gguf file."""
    from splitserve.loader.resolve import DEFAULT_MODEL_HUB_ID, default_model_path

    try:
        if not os.path.samefile(gguf_path, default_model_path()):
            return None
    except (OSError, FileNotFoundError):
        return None
    file = os.path.join(_BUILTIN_DIRECTORY, DEFAULT_MODEL_HUB_ID.replace("/", "--") + ".json")
    return file if os.path.isfile(file) else None


def _from_json_file(file: str) -> dict[str, Any]:
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Cannot read the generation config {file}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"The generation config {file} is not a JSON object.")
    return _translate(raw, file)


def _translate(raw: dict, source: str) -> dict[str, Any]:
    """The sampling fields of a generation-config dict; unknown keys are left (a generation config
    holds many that are not sampling defaults: eos_token_id, do_sample ...)."""
    out = {}
    for key, value in raw.items():
        if key in _HF_KEYS and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{source}: {key} must be a number, got {value!r}.")
            out[_HF_KEYS[key]] = value
    return out


def _from_gguf(path: str) -> dict[str, Any]:
    from splitserve.loader.gguf_file import read_gguf_metadata

    metadata = read_gguf_metadata(path)
    return {field: metadata[key] for key, field in _GGUF_KEYS.items() if key in metadata}


def _check_values(defaults: dict[str, Any]) -> None:
    """The values SamplingParams would refuse, refused at start-up rather than on every request."""
    from splitserve.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"The model's generation config cannot be used as sampling defaults: {exc}") from exc
