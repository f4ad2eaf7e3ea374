"""LMDeploy's deprecated call-level sampling arguments (`pipe(prompts, request_output_len=..., top_k=...)`),
turned into the GenerationConfig they stand for, with a DeprecationWarning as LMDeploy gives."""

from __future__ import annotations

import warnings

from splitserve.entrypoints.lmdeploy_generation import GenerationConfig

_LEGACY_CALL_ARGS = {  # LMDeploy's deprecated call-level arguments and the defaults its document gives
    "request_output_len": ("max_new_tokens", 512),
    "top_k": ("top_k", 40),
    "top_p": ("top_p", 0.8),
    "temperature": ("temperature", 0.8),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "ignore_eos": ("ignore_eos", False),
}


def gen_config_from_call(gen_config, legacy: dict):
    """gen_config, or one built from the deprecated call-level arguments (request_output_len,
    top_k, ...) with the defaults LMDeploy's document gives them."""
    if not legacy:
        return gen_config
    unknown = sorted(set(legacy) - set(_LEGACY_CALL_ARGS))
    if unknown:
        raise TypeError(f"Unexpected keyword arguments {unknown}; sampling settings go in gen_config.")
    if gen_config is not None:
        raise ValueError(f"Give gen_config or the deprecated {sorted(legacy)}, not both.")
    warnings.warn(
        f"{sorted(legacy)} are deprecated (as in LMDeploy): pass gen_config=GenerationConfig(...).",
        DeprecationWarning,
        stacklevel=3,
    )
    return GenerationConfig(
        **{field: legacy.get(name, default) for name, (field, default) in _LEGACY_CALL_ARGS.items()}
    )
