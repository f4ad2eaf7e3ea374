"""Weights updated in a running engine from a checkpoint on disk (`POST /update_weights`, also
SGLang's `/update_weights_from_disk`; offline `LLM.update_weights`), for reinforcement-learning
loops where a trainer writes a new checkpoint of the same model between rollouts.

The engine must be idle and awake (as for sleep: engine/core/sleep_mode.py), and the checkpoint must be
the same architecture with the same shapes (config.json compared key by key; a mismatch is refused
before anything changes). Every rank then drops its model runner and builds it again from the new
checkpoint (level 2 of sleep mode, waking with other weights), so that each quantization's packing
and each rank's shard are made exactly as at start-up. The prefix cache is emptied: its blocks were
computed with the old weights. If loading fails, the previous weights are loaded again and the
error says so. The new path stays for later wake-ups; an engine that dies and is restarted by the
server starts from the command line's model again."""

from __future__ import annotations

import logging
import os
import time

from splitserve.loader.resolve import load_hf_config, resolve_load_format

logger = logging.getLogger(__name__)

# The config.json keys that fix the shapes of the weights (and how they are stored).
SHAPE_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "vocab_size",
    "tie_word_embeddings",
    "quantization_config",
)


def check_compatible(running_config, path: str, load_format: str, trust_remote_code: bool) -> str:
    """The checkpoint's load format, once its config matches the running model's shapes; a
    ValueError that names the first key that differs otherwise."""
    if not os.path.exists(path):
        raise ValueError(f"model_path {path!r} does not exist on the engine's machine.")
    fmt = resolve_load_format(load_format, path)
    if fmt == "dummy":
        raise ValueError("load_format 'dummy' reads no weights: give a checkpoint's format (auto, safetensors, pt).")
    try:
        new_config = load_hf_config(path, trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot read the config of {path}: {exc}") from None
    for key in SHAPE_KEYS:
        old, new = _plain(getattr(running_config, key, None)), _plain(getattr(new_config, key, None))
        if old != new:
            raise ValueError(
                f"{path} is not the running model's shape: its {key} is {new!r}, the running model's {old!r}. "
                "Updating weights keeps the architecture; start a new server for another model."
            )
    return fmt


def _plain(value):
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    return list(value) if isinstance(value, tuple) else value


def update_weights(core, path: str, load_format: str = "auto") -> float:
    """Load the checkpoint at `path` into every rank of `core` (an idle, awake EngineCore); returns
    the seconds it took. ValueError for anything refused (nothing changed) or a failed load (the
    previous weights loaded again)."""
    sleeping = core.sleeping
    if sleeping.level:
        raise ValueError(f"The engine is asleep (level {sleeping.level}): wake it up before updating its weights.")
    sleeping.check_idle("updating weights")
    mc = core.config.model_config
    fmt = check_compatible(mc.hf_config, path, load_format, mc.trust_remote_code)
    start = time.perf_counter()
    previous = (mc.model, mc.load_format)
    sleeping.sleep(2)  # every rank drops its runner; the prefix cache is emptied
    try:
        sleeping.wake_up((path, fmt))
    except Exception as exc:
        logger.error("Loading weights from %s failed (%s): loading %s again", path, exc, previous[0])
        core.executor.sleep(2)  # the ranks that built the new runner drop it (still asleep at level 2)
        sleeping.wake_up(previous)
        raise ValueError(
            f"Loading the weights of {path} failed: {exc}. The previous weights were loaded again."
        ) from exc
    mc.model, mc.load_format = path, fmt
    if (tier := core.kv_manager.pool.tier) is not None:  # the KV offloading tier keeps no block of the old weights
        tier.new_weights(core.config)
    seconds = time.perf_counter() - start
    logger.info("Weights updated from %s (%s) in %.2f s; prefix cache emptied", path, fmt, seconds)
    return seconds
