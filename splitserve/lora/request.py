"""LoRARequest: which adapter a request runs with, as vLLM names it, and the `--lora-modules`
specifications that name adapters at start-up."""

from __future__ import annotations

import json

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True):
    """A LoRA adapter: `lora_name` (what requests call it: the OpenAI `model` field), `lora_int_id`
    (its identity inside the engine: positive, one per adapter; the prefix cache keys blocks by it)
    and `lora_path` (a PEFT checkpoint directory). `base_model_name`: the model it was trained on,
    shown as its parent in /v1/models."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("A LoRA adapter needs a name.")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id}.")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a path (a PEFT checkpoint directory).")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoRAModulePath(msgspec.Struct, frozen=True):
    """One adapter named at start-up (`--lora-modules`, LMDeploy's `adapters`)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(specs: list[str] | None) -> list[LoRAModulePath]:
    """`--lora-modules` values, as vLLM takes them: `name=path`, or a JSON object with `name`,
    `path` and optionally `base_model_name`. Names must be distinct."""
    modules: list[LoRAModulePath] = []
    for spec in specs or []:
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                fields = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {spec!r} is not valid JSON: {exc}") from None
            unknown = set(fields) - {"name", "path", "base_model_name"}
            if unknown or not isinstance(fields.get("name"), str) or not isinstance(fields.get("path"), str):
                raise ValueError(
                    f"--lora-modules {spec!r}: a JSON adapter takes 'name' and 'path' (strings) and "
                    f"optionally 'base_model_name'{'; not ' + ', '.join(sorted(unknown)) if unknown else ''}."
                )
            modules.append(LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name")))
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r} must be 'name=path' or a JSON object.")
        modules.append(LoRAModulePath(name, path))
    names = [m.name for m in modules]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"--lora-modules names each adapter once; {', '.join(duplicated)} appear twice.")
    return modules
