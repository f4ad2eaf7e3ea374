"""The models a server answers to (vLLM's OpenAIServingModels): the base model, under its served
name or "default", and the LoRA adapters of the engine, each under its own name. /v1/models lists
them; /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters at run time."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from splitserve.engine.async_llm import AsyncLLM, EngineDeadError
from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.control_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from splitserve.entrypoints.openai.response_models import ModelCard, ModelList
from splitserve.lora.request import LoRARequest

_DEFAULT_MODEL_ALIASES = (None, "default")


class OpenAIServingModels:
    def __init__(self, engine: AsyncLLM, config):
        self.engine = engine
        self.served_name = config.model_config.served_model_name
        self.root = config.model_config.model
        self.max_model_len = config.model_config.max_model_len
        self.lora_enabled = config.lora_config is not None

    def is_base_model(self, name: str | None) -> bool:
        return name in _DEFAULT_MODEL_ALIASES or name == self.served_name

    async def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); a 404 for anything else."""
        if self.is_base_model(name):
            return None
        lora = await self._call(self.engine.resolve_lora, name) if self.lora_enabled else None
        if lora is None:
            served = [self.served_name, *(sorted(self.engine.loras) if self.lora_enabled else [])]
            raise APIError(
                f"The model {name!r} does not exist; this server serves {', '.join(map(repr, served))}.",
                404,
                "not_found_error",
                "model",
            )
        return lora

    async def show_available_models(self) -> dict:
        cards = [ModelCard(id=self.served_name, root=self.root, max_model_len=self.max_model_len)]
        if self.lora_enabled:
            await self._call(self.engine.lora_call, "list")
            for lora in sorted(self.engine.loras.values(), key=lambda lora: lora.lora_int_id):
                parent = lora.base_model_name or self.served_name
                cards.append(ModelCard(id=lora.lora_name, root=lora.lora_path, parent=parent))
        return ModelList(data=cards).model_dump()

    async def load_lora_adapter(self, body: dict) -> str:
        req = self._request(LoadLoRAAdapterRequest, body)
        if self.is_base_model(req.lora_name):
            raise APIError(f"{req.lora_name!r} is the base model's name; give the adapter another.", param="lora_name")
        reply = await self._call(self.engine.lora_call, "add", req.lora_name, req.lora_path, req.base_model_name)
        if reply.error is not None:
            raise APIError(reply.error, param="lora_path")
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload_lora_adapter(self, body: dict) -> str:
        req = self._request(UnloadLoRAAdapterRequest, body)
        reply = await self._call(self.engine.lora_call, "remove", req.lora_name)
        if reply.error is not None and reply.not_found:
            raise APIError(reply.error, 404, "not_found_error", "lora_name")
        if reply.error is not None:
            raise APIError(reply.error, param="lora_name")
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def _request(self, model: type[BaseModel], body: dict):
        if not self.lora_enabled:
            raise APIError("LoRA adapters are not enabled on this server: start it with --enable-lora.")
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise APIError(f"{'.'.join(map(str, error['loc']))}: {error['msg']}", param=str(error["loc"][0])) from None

    @staticmethod
    async def _call(method, *args):
        try:
            return await method(*args)
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable") from None
