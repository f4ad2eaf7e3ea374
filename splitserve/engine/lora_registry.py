"""The LoRA adapters an engine serves: the one list every front-end (the offline LLM, each API server
worker) reads, so that an adapter has one id however many processes name it.

An adapter is read and checked here (lora/peft.py) before any rank is told about it, so that a bad
adapter is an error for whoever added it, not a failed rank. Adding one that is already there is a
no-op; its name may not be taken by another. Every change bumps `version`, which the engine reports
with its stats, so that API workers notice adapters added or removed through another worker.
"""

from __future__ import annotations

import logging

from splitserve.config import EngineConfig
from splitserve.engine.messages import LoRACall, LoRAReply
from splitserve.lora.peft import BaseModelShapes, load_lora_model
from splitserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRANotFoundError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class LoRARegistry:
    def __init__(self, config: EngineConfig, executor):
        self.config = config.lora_config
        self.executor = executor
        self.shapes = BaseModelShapes.from_hf_config(config.model_config.hf_text_config) if self.enabled else None
        self.by_id: dict[int, LoRARequest] = {}
        self.version = 0
        self._next_id = 1  # ids are never reused: the prefix cache keys KV blocks by them
        for module in self.config.lora_modules if self.config is not None else []:
            self.add_named(module.name, module.path, module.base_model_name)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise ValueError("LoRA adapters are not enabled on this engine: start it with --enable-lora.")

    def by_name(self, name: str) -> LoRARequest | None:
        return next((lora for lora in self.by_id.values() if lora.lora_name == name), None)

    def add(self, lora: LoRARequest) -> LoRARequest:
        """Serve `lora` (its id chosen by the caller, as the offline API does); returns it."""
        self._require_enabled()
        known = self.by_id.get(lora.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(
                    f"LoRA id {lora.lora_int_id} is already adapter {known.lora_name!r} ({known.lora_path}); "
                    "give each adapter its own id."
                )
            return known
        named = self.by_name(lora.lora_name)
        if named is not None:
            raise ValueError(f"The LoRA adapter {lora.lora_name!r} is already loaded (from {named.lora_path}).")
        load_lora_model(lora, self.shapes, self.config.max_lora_rank)  # raises, naming what does not fit
        self.executor.add_lora(lora)
        self.by_id[lora.lora_int_id] = lora
        self._next_id = max(self._next_id, lora.lora_int_id + 1)
        self.version += 1
        logger.info("Serving LoRA adapter %r (id %d) from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
        return lora

    def add_named(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve an adapter by name (an API server's load): the engine picks its id."""
        self._require_enabled()
        named = self.by_name(name)
        if named is not None and named.lora_path == path:
            return named
        return self.add(LoRARequest(name, self._next_id, path, base_model_name))

    def remove(self, name: str) -> LoRARequest:
        self._require_enabled()
        lora = self.by_name(name)
        if lora is None:
            raise LoRANotFoundError(f"The LoRA adapter {name!r} cannot be found.")
        self.executor.remove_lora(lora.lora_int_id)
        del self.by_id[lora.lora_int_id]
        self.version += 1
        logger.info("Stopped serving LoRA adapter %r (id %d)", name, lora.lora_int_id)
        return lora

    def call(self, call: LoRACall) -> LoRAReply:
        """A front-end's LoRA call (add, remove, list), answered with the adapters after it."""
        try:
            if call.op == "add" and call.lora_int_id:  # the caller's id (the offline API's, data parallel)
                self.add(LoRARequest(call.name, call.lora_int_id, call.path, call.base_model_name))
            elif call.op == "add":
                self.add_named(call.name, call.path, call.base_model_name)
            elif call.op == "remove":
                self.remove(call.name)
            elif call.op != "list":
                raise ValueError(f"unknown LoRA call {call.op!r}")
        except LoRANotFoundError as exc:
            return LoRAReply(call.call_id, self.version, self.list(), str(exc), not_found=True)
        except ValueError as exc:
            return LoRAReply(call.call_id, self.version, self.list(), str(exc))
        return LoRAReply(call.call_id, self.version, self.list())

    def list(self) -> list[LoRARequest]:
        return sorted(self.by_id.values(), key=lambda lora: lora.lora_int_id)

    def request_counts(self, scheduler) -> dict[str, dict[str, int]]:
        """The SchedulerStats fields running_loras and waiting_loras: each adapter's requests running
        and waiting in `scheduler`, by adapter name; nothing with LoRA off."""
        if not self.enabled:
            return {}
        return {"running_loras": _by_adapter(scheduler.running), "waiting_loras": _by_adapter(scheduler.waiting)}

    def check_request(self, lora: LoRARequest) -> None:
        """A request may only name an adapter this engine serves, under the id it serves it with."""
        self._require_enabled()
        if self.by_id.get(lora.lora_int_id) != lora:
            raise LoRANotFoundError(
                f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}) is not loaded in this engine."
            )


def _by_adapter(requests) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts
