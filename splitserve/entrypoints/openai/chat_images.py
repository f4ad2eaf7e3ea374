"""Images in the chat requests of the server: `image_url` content parts loaded (data URIs, files under
--allowed-local-media-path, http(s) URLs fetched with a timeout and a size cap, to
--allowed-media-domains when given) before the template renders the conversation, each failure a
400 naming the part; then the rendered prompt carries the images to the engine's processor."""

from __future__ import annotations

import asyncio

from splitserve import envs
from splitserve.engine.processor import Processor, PromptType
from splitserve.entrypoints.http import APIError
from splitserve.multimodal import chat
from splitserve.multimodal.media import MediaConfig, MediaError, load_image_async


def media_config(server_args) -> MediaConfig:
    return MediaConfig(
        allowed_local_media_path=server_args.allowed_local_media_path,
        allowed_media_domains=server_args.allowed_media_domains,
        fetch_timeout_s=envs.SPLITSERVE_IMAGE_FETCH_TIMEOUT,
    )


async def split_images(messages: list[dict], processor: Processor, template: str | None, config: MediaConfig):
    """(messages for the template, their images loaded): messages unchanged when they have none."""
    if not chat.has_images(messages):
        return messages, []
    if processor.multimodal is None:
        raise APIError(
            f"{processor.model_config.architecture or 'This model'} has no vision encoder: it takes no images.",
            param="messages",
        )
    loaded = await asyncio.gather(*(_load(message, i, config) for i, message in enumerate(messages)))
    return chat.split_images(loaded, processor.multimodal.placeholder, chat.content_format(template))


async def _load(message: dict, index: int, config: MediaConfig) -> dict:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = await asyncio.gather(
        *(_load_part(part, f"messages[{index}].content[{j}]", config) for j, part in enumerate(content))
    )
    return {**message, "content": list(parts)}


async def _load_part(part: dict, where: str, config: MediaConfig) -> dict:
    if part.get("type") != "image_url":
        return part
    try:
        image = await load_image_async(part["image_url"]["url"], config)
    except MediaError as exc:
        raise APIError(f"The image of {where} cannot be used: {exc}", param=where) from None
    return {"type": "image_pil", "image_pil": image}


def chat_prompt(text: str, images: list) -> PromptType:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


async def prompt_token_ids(processor: Processor, prompt: PromptType, add_special_tokens: bool) -> list[int]:
    """The token ids a rendered chat prompt becomes, images expanded to their tokens (/tokenize, token counts)."""
    if isinstance(prompt, str):
        return await asyncio.to_thread(processor.tokenize, prompt, add_special_tokens)
    images = prompt["multi_modal_data"]["image"]
    try:
        ids, _ = await asyncio.to_thread(processor.multimodal.process, prompt["prompt"], images, add_special_tokens)
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from None
    return ids
