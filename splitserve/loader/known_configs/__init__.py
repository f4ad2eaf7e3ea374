"""Built-in Hugging Face configs of a few well-known models, so that `load_format="dummy"` can build
them (random weights, for benchmarks) with no hub access and no download.

Each `<org>--<name>.json` here is the model's published `config.json`, unchanged (the hub id with
`/` replaced by `--`). Only the config is carried: no tokenizer, no weights.
`generation/<org>--<name>.json` is a model's generation config where splitserve carries one (the
embedded default model's, with its authors' recommended sampling; loader/generation_config.py).
"""

from __future__ import annotations

import functools
import glob
import os

_DIRECTORY = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def _files() -> dict[str, str]:
    """Hub id -> JSON file, for every built-in config."""
    files = {}
    for path in sorted(glob.glob(os.path.join(_DIRECTORY, "*--*.json"))):
        org, _, name = os.path.basename(path)[: -len(".json")].partition("--")
        files[f"{org}/{name}"] = path
    return files


def builtin_model_ids() -> list[str]:
    """The hub ids splitserve carries a config for."""
    return list(_files())


def builtin_config_path(model_id: str) -> str | None:
    """The built-in config.json of `model_id` (hub ids match case-insensitively, as on the hub), or None."""
    files = _files()
    if model_id in files:
        return files[model_id]
    lowered = {key.lower(): path for key, path in files.items()}
    return lowered.get(model_id.lower())


def canonical_model_id(model_id: str) -> str | None:
    """`model_id` spelled as the built-in config's hub id, or None when there is none."""
    path = builtin_config_path(model_id)
    return None if path is None else next(key for key, value in _files().items() if value == path)


def load_builtin_config(model_id: str):
    """The transformers config (a PretrainedConfig) of a built-in model; KeyError if there is none."""
    from transformers import AutoConfig

    path = builtin_config_path(model_id)
    if path is None:
        raise KeyError(
            f"splitserve has no built-in config for {model_id!r}; built in: {', '.join(builtin_model_ids())}."
        )
    return AutoConfig.from_pretrained(path)
