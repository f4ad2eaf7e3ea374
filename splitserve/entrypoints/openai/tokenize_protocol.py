"""The request bodies of /tokenize (a text prompt, or messages rendered by the chat template) and
/detokenize (served by serving_tokenize.py)."""

from __future__ import annotations

from typing import Any

from splitserve.entrypoints.openai.protocol import ConversationRequest
from splitserve.entrypoints.openai.request_model import RequestModel


class TokenizeCompletionRequest(RequestModel):
    """POST /tokenize with a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ConversationRequest):
    """POST /tokenize with messages, rendered by the chat template first."""

    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


def parse_tokenize_request(data: Any, context: dict | None = None) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """/tokenize takes either form: the one with `messages` is the chat form. Raises
    pydantic.ValidationError like model_validate."""
    if isinstance(data, dict) and "messages" in data:
        return TokenizeChatRequest.model_validate(data, context=context)
    return TokenizeCompletionRequest.model_validate(data, context=context)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
