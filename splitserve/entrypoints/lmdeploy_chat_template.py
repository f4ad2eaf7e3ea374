"""LMDeploy's chat templates by name: `ChatTemplateConfig(model_name=...)`, and the `model_name`
of `pipeline()` and of both engine configs.

LMDeploy describes a template as pieces of text around each turn: `system` + text + `eosys`,
`user` + text + `eoh`, `assistant` + text + `eoa` + `separator`, with `meta_instruction` as the
system text when the conversation brings none. A named template sets those pieces; the fields a
ChatTemplateConfig gives replace them. `model_name='hf'` (or a config with a jinja `chat_template`)
keeps the tokenizer's own template. An unknown name is an error listing the known ones, never a
silent fallback, since the prompts would change.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

logger = logging.getLogger("splitserve.lmdeploy")

_PIECES = ("system", "meta_instruction", "eosys", "user", "eoh", "assistant", "eoa", "separator")

_INTERNLM_SYSTEM = (
    "You are an AI assistant whose name is InternLM (书生·浦语).\n"
    "- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI "
    "Laboratory (上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
    "- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the "
    "user such as English and 中文."
)

# name -> the pieces of its turns (and the words that end an answer)
NAMED_TEMPLATES: dict[str, dict] = {
    "base": dict(),
    "internlm": dict(
        system="<|System|>:",
        meta_instruction=_INTERNLM_SYSTEM,
        eosys="\n",
        user="<|User|>:",
        eoh="\n",
        assistant="<|Bot|>:",
        eoa="<eoa>",
        separator="\n",
        stop_words=["<eoa>"],
    ),
    "internlm2": dict(
        system="<|im_start|>system\n",
        meta_instruction=_INTERNLM_SYSTEM,
        eosys="<|im_end|>\n",
        user="<|im_start|>user\n",
        eoh="<|im_end|>\n",
        assistant="<|im_start|>assistant\n",
        eoa="<|im_end|>",
        separator="\n",
        stop_words=["<|im_end|>"],
    ),
    "chatml": dict(
        system="<|im_start|>system\n",
        eosys="<|im_end|>\n",
        user="<|im_start|>user\n",
        eoh="<|im_end|>\n",
        assistant="<|im_start|>assistant\n",
        eoa="<|im_end|>",
        separator="\n",
        stop_words=["<|im_end|>"],
    ),
    "qwen": dict(
        system="<|im_start|>system\n",
        meta_instruction="You are a helpful assistant.",
        eosys="<|im_end|>\n",
        user="<|im_start|>user\n",
        eoh="<|im_end|>\n",
        assistant="<|im_start|>assistant\n",
        eoa="<|im_end|>",
        separator="\n",
        stop_words=["<|im_end|>"],
    ),
    "llama2": dict(
        system="[INST] <<SYS>>\n",
        meta_instruction="You are a helpful, respectful and honest assistant.",
        eosys="\n<</SYS>>\n\n",
        user="[INST] ",
        eoh=" [/INST]",
        assistant=" ",
        eoa="</s>",
        separator="",
    ),
    "llama3": dict(
        system="<|start_header_id|>system<|end_header_id|>\n\n",
        eosys="<|eot_id|>",
        user="<|start_header_id|>user<|end_header_id|>\n\n",
        eoh="<|eot_id|>",
        assistant="<|start_header_id|>assistant<|end_header_id|>\n\n",
        eoa="<|eot_id|>",
        separator="",
        stop_words=["<|eot_id|>"],
    ),
    "vicuna": dict(
        meta_instruction="A chat between a curious user and an artificial intelligence assistant. The "
        "assistant gives helpful, detailed, and polite answers to the user's questions.",
        eosys=" ",
        user="USER: ",
        eoh=" ",
        assistant="ASSISTANT: ",
        eoa="</s>",
        separator="",
    ),
}
_ALIASES = {"internlm-chat": "internlm", "internlm-chat-7b": "internlm", "internlm2-chat": "internlm2", "qwen2": "qwen"}
HF_TEMPLATE = "hf"  # the tokenizer's own chat template


def best_match_template(model_path: str) -> str | None:
    """The named template whose name the model's path holds, as LMDeploy picks one for a model
    without a chat template (`internlm/internlm-chat-7b` -> internlm, `internlm2-chat-7b` ->
    internlm2, `Qwen-7B-Chat` -> qwen, `Llama-2-7b-chat-hf` -> llama2); the longest name wins.
    None when no name matches ('base' and 'chatml' name formats, not models, and are never guessed)."""
    key = model_path.rstrip("/").split("/")[-1].lower()
    if key in _ALIASES:
        return _ALIASES[key]
    squeezed = key.replace("-", "").replace("_", "").replace(".", "")
    names = [name for name in NAMED_TEMPLATES if name not in ("base", "chatml") and name in squeezed]
    return max(names, key=len) if names else None


def template_name(model_name: str | None) -> str | None:
    """The known template `model_name` names (None or 'hf': the tokenizer's own); ValueError otherwise."""
    if model_name in (None, "", HF_TEMPLATE):
        return None
    key = model_name.lower().split("/")[-1]
    key = _ALIASES.get(key, key)
    if key not in NAMED_TEMPLATES:
        known = sorted([*NAMED_TEMPLATES, *_ALIASES, HF_TEMPLATE])
        raise ValueError(f"Unknown chat template name {model_name!r}; known names: {', '.join(known)}.")
    return key


@dataclass
class ChatTemplateConfig:
    """LMDeploy's ChatTemplateConfig: `model_name` picks a named template (or 'hf', the tokenizer's);
    the other fields replace its pieces. `chat_template` (splitserve's) is a jinja template that
    replaces the tokenizer's."""

    model_name: str = HF_TEMPLATE
    system: str | None = None
    meta_instruction: str | None = None
    eosys: str | None = None
    user: str | None = None
    eoh: str | None = None
    assistant: str | None = None
    eoa: str | None = None
    separator: str | None = None
    capability: str | None = None
    stop_words: list[str] | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        name = template_name(self.model_name)
        overrides = [f for f in _PIECES if getattr(self, f) is not None]
        if self.chat_template is not None and (name is not None or overrides):
            raise ValueError("ChatTemplateConfig: give a jinja chat_template or a named template, not both.")
        if name is None and overrides:
            raise ValueError(
                f"ChatTemplateConfig: {overrides} change a named template's pieces; with model_name "
                f"{self.model_name!r} the tokenizer's own template is used. Name one of {sorted(NAMED_TEMPLATES)}."
            )
        if self.capability not in (None, "chat", "completion"):
            raise ValueError(f"ChatTemplateConfig.capability must be 'chat' or 'completion', got {self.capability!r}.")

    def named(self) -> NamedChatTemplate | None:
        """The turn-piece template this config describes (None: the tokenizer's or the jinja one)."""
        name = template_name(self.model_name)
        if name is None:
            return None
        pieces = dict(NAMED_TEMPLATES[name])
        pieces.update({f: getattr(self, f) for f in (*_PIECES, "stop_words") if getattr(self, f) is not None})
        return NamedChatTemplate(name=name, **pieces)


@dataclass(frozen=True)
class NamedChatTemplate:
    name: str
    system: str = ""
    meta_instruction: str | None = None
    eosys: str = ""
    user: str = ""
    eoh: str = ""
    assistant: str = ""
    eoa: str = ""
    separator: str = ""
    stop_words: list[str] = dataclasses.field(default_factory=list)

    def render(self, messages: list[dict]) -> str:
        """The prompt of a conversation; it ends where the assistant's answer begins (or inside the
        assistant's last turn, when the conversation ends with one, so the model continues it)."""
        opens = {"system": self.system, "user": self.user, "assistant": self.assistant}
        ends = {"system": self.eosys, "user": self.eoh, "assistant": self.eoa + self.separator}
        text = ""
        if self.meta_instruction is not None and (not messages or messages[0].get("role") != "system"):
            text += self.system + self.meta_instruction + self.eosys
        for message in messages:
            role = message.get("role")
            if role not in opens:
                raise ValueError(f"A message's role must be system, user or assistant for template {self.name!r}.")
            content = message.get("content")
            if not isinstance(content, str):
                raise ValueError(f"Template {self.name!r} takes text content only, got {type(content).__name__}.")
            text += opens[role] + content + ends[role]
        if messages and messages[-1].get("role") == "assistant":
            return text[: len(text) - len(ends["assistant"])] if ends["assistant"] else text
        return text + self.assistant

    def render_prompt(self, prompt: str) -> str:
        """A plain string prompt as one user turn (LMDeploy's do_preprocess=True)."""
        return self.render([{"role": "user", "content": prompt}])


def template_by_model_name(model_path: str) -> NamedChatTemplate | None:
    """For a tokenizer without a chat template: LMDeploy's named template that the model's name
    matches (`best_match_template`), or None (prompts then need do_preprocess=False)."""
    name = best_match_template(model_path)
    if name is None:
        return None
    logger.info(
        "The tokenizer of %s has no chat template: LMDeploy's %r template, by the model's name", model_path, name
    )
    return ChatTemplateConfig(model_name=name).named()


def resolve_chat_template(config, model_name: str | None) -> str | NamedChatTemplate | None:
    """The template prompts are rendered with: a ChatTemplateConfig (or a dict of its fields)
    first, else the template `model_name` names (pipeline's or the backend config's); None: the
    tokenizer's own."""
    if config is None:
        return ChatTemplateConfig(model_name=model_name).named() if model_name else None
    if isinstance(config, dict):
        config = ChatTemplateConfig(**config)
    if not isinstance(config, ChatTemplateConfig):
        raise TypeError(f"chat_template_config must be a ChatTemplateConfig or a dict, got {type(config).__name__}.")
    return config.chat_template if config.chat_template is not None else config.named()
