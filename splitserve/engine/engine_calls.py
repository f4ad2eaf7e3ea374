"""What an AsyncLLM asks of its engine and waits for the answer to (engine/async_llm.py): LoRA adapter
changes and listings (LoRACall) and sleep mode and weight updates (SleepCall), each matched to its
reply by a call id; and the API worker's view of the engine's adapters, which it loads again on an
engine that was restarted.

EngineCalls is a mixin of AsyncLLM: it keeps its own state (set up by _init_calls) and needs of its
host only start(), _caught_up(), _check_alive() and _send(), the way AsyncLLM talks to its engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from splitserve.engine.errors import EngineDeadError
from splitserve.engine.messages import EngineCoreOutputs, LoRACall, LoRAReply, SleepCall, SleepReply
from splitserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class EngineCalls:
    def _init_calls(self) -> None:
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self.loras: dict[str, LoRARequest] = {}  # the engine's adapters by name, as last heard
        self.loras_version = -1  # the registry version they are from (-1: never asked)
        self.engine_loras_version = 0  # the version the engine last reported

    async def _call(self, make_message):
        """Send the message make_message(call_id) and wait for the engine's reply to that call id."""
        self.start()
        await self._caught_up()
        self._check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._send(make_message(call_id))
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _answer_calls(self, message: EngineCoreOutputs) -> None:
        """The replies in an engine message go to the calls waiting for them; its stats carry the
        version of the engine's adapter registry."""
        for reply in (message.lora_reply, message.sleep_reply):
            if reply is not None and reply.call_id in self._calls:
                self._calls[reply.call_id].set_result(reply)
        if message.stats is not None:
            self.engine_loras_version = message.stats.lora_version

    def _fail_calls(self, reason: str) -> None:
        """The engine died: the calls waiting for it fail."""
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"The engine is not running: {reason}"))

    # --- sleep mode -------------------------------------------------------------------------------
    async def sleep_call(self, op: str, level: int = 1, model_path: str = "", load_format: str = "auto") -> SleepReply:
        """sleep (level 1 or 2), wake_up, is_sleeping, reset_prefix_cache (engine/core/sleep_mode.py) or
        update_weights from model_path (engine/core/weight_update.py); the reply has the level the engine
        sleeps at after the call (0: awake) and any refusal."""
        return await self._call(lambda call_id: SleepCall(call_id, op, level, model_path, load_format))

    # --- LoRA adapters ------------------------------------------------------------------------
    async def lora_call(self, op: str, name: str = "", path: str = "", base_model_name: str | None = None) -> LoRAReply:
        """Add ("add"), remove ("remove") or list ("list") the engine's adapters; the reply carries
        the adapters after the call, which become this front-end's view of them."""
        reply = await self._call(lambda call_id: LoRACall(call_id, op, name, path, base_model_name))
        self.loras = {lora.lora_name: lora for lora in reply.loras}
        self.loras_version = reply.version
        return reply

    async def resolve_lora(self, name: str) -> LoRARequest | None:
        """The adapter called `name`, asking the engine when this front-end's view may be old (an
        adapter added or removed through another API worker)."""
        if name not in self.loras or self.loras_version != self.engine_loras_version:
            await self.lora_call("list")
        return self.loras.get(name)

    def _new_engine_loras(self) -> None:
        """Connected to a restarted engine: forget the old one's adapters, and load again those it had
        (in the background)."""
        previous = list(self.loras.values())
        self.loras, self.loras_version, self.engine_loras_version = {}, -1, 0
        if previous:
            asyncio.get_running_loop().create_task(self._restore_loras(previous))

    async def _restore_loras(self, adapters: list[LoRARequest]) -> None:
        """The adapters this front-end knew before the restart and the new engine lacks (loaded at run
        time) are loaded again; with several API workers the first one to ask loads each."""
        try:
            await self.lora_call("list")
            for adapter in adapters:
                if adapter.lora_name not in self.loras:
                    reply = await self.lora_call("add", adapter.lora_name, adapter.lora_path, adapter.base_model_name)
                    if reply.error and adapter.lora_name not in self.loras:
                        logger.error("LoRA adapter %s could not be loaded again: %s", adapter.lora_name, reply.error)
                    else:
                        logger.info("LoRA adapter %s loaded again after the engine restart", adapter.lora_name)
        except EngineDeadError:
            pass
