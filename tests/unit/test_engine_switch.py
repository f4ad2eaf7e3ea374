"""A request that arrives after the supervisor restarted the engine, but before the API worker's output
loop switched to the new one, waits for the switch instead of going out on the dead engine's socket
(where the switch fails it with the dead engine's requests: a 503 for a request sent after the restart)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from splitserve.engine.async_llm import AsyncLLM


def _front_end(engine_generation: int, seen_generation: int) -> SimpleNamespace:
    front = SimpleNamespace(engine_watch=SimpleNamespace(generation=engine_generation), generation=seen_generation)
    front._replaced = lambda: AsyncLLM._replaced(front)
    return front


def test_a_request_waits_for_the_switch_to_the_restarted_engine():
    async def scenario():
        front = _front_end(engine_generation=1, seen_generation=0)

        async def output_loop():  # notices the new engine a little later, then keeps reading
            await asyncio.sleep(0.05)
            front.generation = 1
            await asyncio.sleep(10)

        front._output_task = asyncio.create_task(output_loop())
        await asyncio.wait_for(AsyncLLM._caught_up(front), 2)
        assert front.generation == 1  # it went on only once the loop had switched
        front._output_task.cancel()

    asyncio.run(scenario())


def test_nothing_to_wait_for_without_a_restart_or_an_output_loop():
    async def scenario():
        await asyncio.wait_for(AsyncLLM._caught_up(_front_end(2, 2)), 1)  # up to date
        stopped = _front_end(3, 2)
        stopped._output_task = None  # no loop to switch: _check_alive reports the state instead
        await asyncio.wait_for(AsyncLLM._caught_up(stopped), 1)

    asyncio.run(scenario())
