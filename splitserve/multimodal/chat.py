"""Chat messages with images: OpenAI's content parts (`{"type": "image_url", "image_url": {"url": ...}}`,
and vLLM's `{"type": "image_pil", "image_pil": image}` offline) turned into what a chat template can
render plus the images in the order their placeholders appear.

Templates take content in one of two forms, as vLLM distinguishes them: "openai" templates loop over
a message's parts and write the image token for `{"type": "image"}` parts themselves (LLaVA's,
Qwen2-VL's); "string" templates print the content as a string, so the model's image placeholder is
written into the text, one per image before the message's text (vLLM's placement). The form is read
from the template's source: whether it loops over a message's content.
"""

from __future__ import annotations

from typing import Any

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def content_format(template: str | None) -> str:
    """ "openai" when the template iterates over a message's content, else "string"."""
    if not template:
        return "string"
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in tree.find_all(nodes.For):
        if _reads_content(loop.iter):
            return "openai"
    return "string"


def _reads_content(node) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Filter):  # message['content'] | selectattr(...) and the like
        return node.node is not None and _reads_content(node.node)
    return False


def has_images(messages: list[dict]) -> bool:
    return any(_is_image(part) for message in messages for part in _parts(message))


def split_images(messages: list[dict], placeholder: str, form: str) -> tuple[list[dict], list[Any]]:
    """(messages to render, image sources in placeholder order): image parts become {"type": "image"}
    parts ("openai" form) or placeholders at the front of the message's text ("string" form)."""
    rendered, images = [], []
    for message in messages:
        parts = _parts(message)
        if not any(_is_image(part) for part in parts):
            rendered.append(message)
            continue
        found = [_image_source(part) for part in parts if _is_image(part)]
        images.extend(found)
        if form == "openai":
            content = [{"type": "image"} if _is_image(part) else part for part in parts]
        else:
            texts = [part.get("text", "") for part in parts if not _is_image(part)]
            content = "\n".join([placeholder] * len(found) + texts)
        rendered.append({**message, "content": content})
    return rendered, images


def _parts(message: dict) -> list:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def _image_source(part: dict):
    """An image part's image: a URL (data:, file:, http(s):) or a PIL image."""
    kind = part["type"]
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    if value is None:
        raise ValueError(f"An {kind!r} content part must carry its image in {kind!r}.")
    return value


def split_for_template(messages: list[dict], multimodal, template: str | None) -> tuple[list[dict], list[Any]]:
    """split_images for a model's MultiModalProcessor (None: a text model, which refuses images)."""
    if not has_images(messages):
        return messages, []
    if multimodal is None:
        raise ValueError("This model has no vision encoder: it takes no images.")
    return split_images(messages, multimodal.placeholder, content_format(template))


def rendered_prompt(text: str, images: list) -> dict:
    """A rendered chat prompt with its images: the template wrote its special tokens already."""
    return {"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False}


def is_image_prompt(prompt) -> bool:
    """LMDeploy's (prompt, image) or (prompt, [images]) pair (a second str would be another prompt)."""
    return (
        isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[0], str) and not isinstance(prompt[1], str)
    )


def image_prompt_messages(text: str, images) -> list[dict]:
    """LMDeploy's pair as one user message: its images, then its text."""
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    return [
        {
            "role": "user",
            "content": [*({"type": "image_pil", "image_pil": i} for i in images), {"type": "text", "text": text}],
        }
    ]
