"""EngineCalls (engine/engine_calls.py), AsyncLLM's calls of its engine, over a stand-in engine that
answers each LoRACall at once: replies matched by call id, calls failing when the engine dies, and
the adapters of an engine that was restarted loaded again on the new one."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.engine_calls import EngineCalls
from splitserve.engine.errors import EngineDeadError
from splitserve.engine.messages import EngineCoreOutputs, LoRACall, LoRAReply, SleepCall, SleepReply
from splitserve.lora.request import LoRARequest


class Host(EngineCalls):
    """What EngineCalls needs of an AsyncLLM, with an engine that keeps its adapters in a dict."""

    def __init__(self, answer: bool = True):
        self._init_calls()
        self.answer = answer
        self.sent = []
        self.engine_loras: dict[str, LoRARequest] = {}
        self.version = 0

    def start(self) -> None:
        pass

    async def _caught_up(self) -> None:  # no restarted engine to switch to
        pass

    def _check_alive(self) -> None:
        pass

    async def _send(self, message) -> None:
        self.sent.append(message)
        if not self.answer:
            return
        if isinstance(message, SleepCall):
            reply = EngineCoreOutputs(sleep_reply=SleepReply(message.call_id, message.level))
        else:
            assert isinstance(message, LoRACall)
            if message.op == "add":
                lora = LoRARequest(message.name, len(self.engine_loras) + 1, message.path, message.base_model_name)
                self.engine_loras[message.name] = lora
                self.version += 1
            loras = list(self.engine_loras.values())
            reply = EngineCoreOutputs(lora_reply=LoRAReply(message.call_id, self.version, loras))
        asyncio.get_running_loop().call_soon(self._answer_calls, reply)


def test_calls_get_their_replies_and_the_lora_view_follows():
    async def main():
        host = Host()
        assert (await host.sleep_call("sleep", 2)).sleep_level == 2
        reply = await host.lora_call("add", "a", "/p/a", "base")
        assert reply.version == 1 and list(host.loras) == ["a"] and host.loras_version == 1
        assert await host.resolve_lora("missing") is None
        assert [type(m).__name__ for m in host.sent] == ["SleepCall", "LoRACall", "LoRACall"]
        assert len({m.call_id for m in host.sent}) == 3 and not host._calls

    asyncio.run(main())


def test_calls_fail_when_the_engine_dies():
    async def main():
        host = Host(answer=False)
        call = asyncio.ensure_future(host.lora_call("list"))
        await asyncio.sleep(0)
        host._fail_calls("killed")
        with pytest.raises(EngineDeadError, match="killed"):
            await call
        assert not host._calls

    asyncio.run(main())


def test_a_restarted_engine_gets_the_adapters_again():
    async def main():
        host = Host()
        await host.lora_call("add", "a", "/p/a", "base")
        await host.lora_call("add", "b", "/p/b")
        host.engine_loras, host.version = {"b": host.engine_loras["b"]}, 0  # the new engine loaded b itself
        host._new_engine_loras()
        assert host.loras == {} and host.loras_version == -1 and host.engine_loras_version == 0
        for _ in range(20):
            await asyncio.sleep(0)
        assert sorted(host.engine_loras) == ["a", "b"] and host.engine_loras["a"].base_model_name == "base"
        assert sorted(host.loras) == ["a", "b"]
        assert [m.op for m in host.sent[2:]] == ["list", "add"]

    asyncio.run(main())
