"""Configuration objects given as JSON on the command line (--speculative-config,
--kv-events-config ...): one dataclass from a dict or its JSON, unknown keys refused by name."""

from __future__ import annotations

import dataclasses
import json


def config_from_json(cls, value, flag: str):
    """An instance of the dataclass `cls` from a dict or its JSON (a flag such as
    --speculative-config); a ValueError that names the flag for bad JSON and unknown keys."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{flag} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}.")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{flag} has unknown keys {unknown}; known keys: {sorted(known)}.")
    return cls(**value)
