"""The router's own tokenizer (`splitserve router --tokenizer PATH`): the cache_aware policy hashes a
prompt's tokens, and with the model's tokenizer here the router renders and tokenizes a text or a
chat itself, as an instance would (the same request models, chat template and flags), instead of
asking an instance's /tokenize once per request; on busy instances that call costs as much as the
prefix it saves."""

from __future__ import annotations

from pydantic import ValidationError

from splitserve.entrypoints.openai.chat_messages import template_kwargs
from splitserve.entrypoints.openai.protocol import ChatCompletionRequest
from splitserve.multimodal.chat import has_images
from splitserve.tokenizer import apply_chat_template, get_tokenizer


class RouterTokenizer:
    def __init__(self, path: str):
        self.tokenizer = get_tokenizer(path)

    def prompt_ids(self, body: dict) -> list[int] | None:
        """The token ids an instance would compute for this completion or chat body; None when the
        router cannot tell (a malformed body, images, whose tokens only the instance's processor knows)."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if not isinstance(body.get("messages"), list):
            return None
        try:
            req = ChatCompletionRequest.model_validate(body)
        except (ValidationError, ValueError):
            return None
        messages = req.template_messages()
        if has_images(messages):
            return None
        try:
            text = apply_chat_template(
                self.tokenizer,
                messages,
                req.chat_template,
                req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                **template_kwargs(req),
            )
        except Exception:  # noqa: BLE001 - the instance will answer the request's own error
            return None
        return self.tokenizer(text, add_special_tokens=False).input_ids
