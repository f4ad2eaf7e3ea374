"""Model configs kept as plain attributes after the first load, so that later starts do not import
transformers' config classes.

Since transformers 5, importing any model's config class (LlamaConfig, Qwen2Config, ...) imports
transformers' activation functions and through them torch._dynamo and torch.distributed.tensor:
1.4-1.7 s in every process that reads a config (the API server, its engine process, each API
worker), more than the rest of a warm start of the default model. splitserve only reads a config's
attributes, so once transformers has built a config, its attributes are saved to
`~/.cache/splitserve/configs/<key>.json` and later loads rebuild a transformers `PreTrainedConfig`
(the base class, which imports nothing heavy) holding the same attributes. The key changes with the
config.json bytes, the transformers version and this file's format.

A config is saved only when the rebuilt copy answers every attribute the original has as the
original does (checked when saving); configs with nested configs (multimodal models) or values JSON
cannot carry are read by transformers at every start, as before. `as_transformers_config` gives
transformers' own class back where transformers needs it (building its model for a baseline).
SPLITSERVE_CONFIG_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

from splitserve import envs

logger = logging.getLogger(__name__)

_FORMAT = 1
_CLASS_NAME = "__config_class__"  # the original class's name
_CLASS_ATTRIBUTES = "__class_attributes__"  # the names that were the class's, not the instance's


def enabled() -> bool:
    return envs.SPLITSERVE_CONFIG_CACHE


def _cache_path(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "config.json"), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    import transformers

    digest = hashlib.sha256(raw + f"\0{transformers.__version__}\0{_FORMAT}".encode()).hexdigest()[:24]
    return os.path.join(envs.cache_root(), "configs", f"{digest}.json")


def cached_config(directory: str):
    """The config of `directory` rebuilt from the cache, or None when it has not been saved."""
    if not enabled() or (path := _cache_path(directory)) is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f, object_hook=_decode)
    except (OSError, ValueError):
        return None
    config = _rebuild(state)
    config._name_or_path = directory  # the cache is shared by identical config.json files
    return config


def remember_config(directory: str, config) -> None:
    """Save `config` (built by transformers from `directory`) for later loads, if it survives the
    trip: otherwise later loads keep reading it with transformers (logged once here)."""
    if not enabled() or (path := _cache_path(directory)) is None:
        return
    state = _state(config)
    transformers_logger = logging.getLogger("transformers")
    level = transformers_logger.level
    transformers_logger.setLevel(logging.ERROR)  # reading deprecated aliases (torch_dtype, ...) warns
    try:
        problem = "it holds values JSON cannot carry" if state is None else _differences(config, _rebuild(state))
    finally:
        transformers_logger.setLevel(level)
    if problem:
        logger.info(
            "The config of %s is read by transformers at every start (%s is not kept as plain attributes: %s).",
            directory,
            type(config).__name__,
            problem,
        )
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
            json.dump(_encode(state), f)
        os.replace(f.name, path)
    except OSError as exc:
        logger.warning("Could not cache the config of %s (%s): transformers reads it at every start.", directory, exc)


def as_transformers_config(config):
    """transformers' own config class for `config` (itself when it is one already)."""
    name = getattr(config, _CLASS_NAME, None)
    if name is None:
        return config
    from transformers import AutoConfig

    skip = {_CLASS_NAME, _CLASS_ATTRIBUTES, "model_type", *getattr(config, _CLASS_ATTRIBUTES)}
    attributes = {key: value for key, value in vars(config).items() if key not in skip}
    return AutoConfig.for_model(config.model_type, **attributes)


def _state(config) -> dict | None:
    """The config's instance attributes and its class's plain data attributes, or None if some
    value does not survive JSON."""
    from transformers.configuration_utils import PreTrainedConfig

    state = {}
    for cls in reversed(type(config).__mro__):
        if cls is PreTrainedConfig or not issubclass(cls, PreTrainedConfig):
            continue
        for name, value in vars(cls).items():
            if not name.startswith("__") and _is_data(value):
                state[name] = value
    state[_CLASS_ATTRIBUTES] = [name for name in state if name not in vars(config)]
    state.update(vars(config))
    state[_CLASS_NAME] = type(config).__name__
    try:
        text = json.dumps(_encode(state))
    except (TypeError, ValueError):
        return None
    return state if json.loads(text, object_hook=_decode) == state else None


def _is_data(value) -> bool:
    return isinstance(value, (str, int, float, bool, list, tuple, dict)) or value is None


def _rebuild(state: dict):
    from transformers.configuration_utils import PreTrainedConfig

    config = PreTrainedConfig.__new__(PreTrainedConfig)
    config.__dict__.update(state)
    return config


def _differences(original, rebuilt) -> str:
    """'' when `rebuilt` answers every attribute of `original` alike (its values equal, its objects of
    the same type), else the first that differs."""
    for name in dir(original):
        if name.startswith("__"):
            continue
        try:
            expected = getattr(original, name)
        except Exception as exc:  # a property that raises must raise alike
            expected = type(exc)
        if callable(expected) and not isinstance(expected, type):
            continue
        try:
            got = getattr(rebuilt, name)
        except Exception as exc:
            got = type(exc)
        same = got == expected if _is_data(expected) or isinstance(expected, type) else type(got) is type(expected)
        if not same:  # objects (views over the config) are compared by their type only
            return f"{name} = {got!r} instead of {expected!r}"
    return ""


def _encode(value):
    """`value` with tuples, integer-keyed dicts and torch dtypes spelled as JSON objects that
    `_decode` turns back."""
    import torch

    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: _encode(item) for key, item in value.items()}
        if all(isinstance(key, int) and not isinstance(key, bool) for key in value):  # id2label
            return {"__int_keys__": [[key, _encode(item)] for key, item in value.items()]}
        raise TypeError("a dict with keys other than strings or integers")
    if isinstance(value, (list, tuple)):
        items = [_encode(item) for item in value]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise TypeError(f"{type(value).__name__} is not JSON")


def _decode(obj: dict):
    if "__tuple__" in obj and len(obj) == 1:
        return tuple(obj["__tuple__"])
    if "__int_keys__" in obj and len(obj) == 1:
        return {key: item for key, item in obj["__int_keys__"]}
    if "__dtype__" in obj and len(obj) == 1:
        import torch

        return getattr(torch, obj["__dtype__"])
    return obj
