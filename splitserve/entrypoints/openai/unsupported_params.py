"""Known OpenAI/vLLM request parameters that splitserve does not implement. Request bodies declare
them (protocol.py) so that they can be refused by name unless their value turns the feature off:
a client that sends `audio` or `prediction` must learn that they are not honoured."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationInfo

# Known OpenAI/vLLM parameters that splitserve does not implement, with the only values accepted
# (the ones meaning "feature off"); any other value is refused rather than silently ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    # chat only
    "functions": (None,),
    "reasoning_effort": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}


def refuse_unsupported(value: Any, info: ValidationInfo) -> Any:
    """Let a known-but-unimplemented parameter through only with a value that turns it off."""
    accepted = UNSUPPORTED[info.field_name]
    # The type check keeps 0 from passing as False (0 == False in Python).
    if any(value == ok and type(value) is type(ok) for ok in accepted):
        return value
    allowed = " or ".join(json.dumps(ok) for ok in accepted)
    raise ValueError(f"'{info.field_name}' is not supported by splitserve (only {allowed} is accepted).")
