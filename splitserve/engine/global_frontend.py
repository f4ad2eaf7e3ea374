"""The front-end of an API worker under FastDeploy's global scheduler (`--scheduler-name global`):
an AsyncLLM whose requests go through Redis (engine/global_scheduler.py) instead of straight to its
engine.

GlobalSchedulerAsyncLLM is what serve_worker builds in place of the AsyncLLM when the server runs
the global scheduler (one engine replica: refused with data parallelism). It is an AsyncLLM, so the
serving layer uses it as one; it changes only where requests, aborts and outputs go:
- a new core request goes to this node's queue in Redis (or to its own engine when no other
  instance may run it);
- an abort reaches the request wherever it is (the queue, another instance's engine, or this one's);
- the engine's outputs of requests run for other instances go to those instances' inboxes; this
  node's own are delivered as usual (outputs of its requests run elsewhere come through deliver());
- /abort_requests reaches every instance of the topic;
- when the engine dies, the requests queued or running elsewhere go too, and those this instance
  ran for others fail at their origins.
start() also starts the scheduler's loops (pulling, the inbox, the heartbeat); the server ends them
with GlobalScheduler.close().
"""

from __future__ import annotations

import asyncio

from splitserve.engine.async_llm import AsyncLLM
from splitserve.engine.global_scheduler import GlobalScheduler
from splitserve.engine.messages import EngineCoreOutput, EngineCoreRequest


class GlobalSchedulerAsyncLLM(AsyncLLM):
    def __init__(self, global_scheduler: GlobalScheduler, *args, **kwargs):
        """global_scheduler: this node's GlobalScheduler; the rest: AsyncLLM's arguments."""
        super().__init__(*args, **kwargs)
        self.global_scheduler = global_scheduler

    def start(self) -> None:
        """Read the engine's outputs and pull work (from this node's queue and the others')."""
        super().start()
        self.global_scheduler.start(self)

    async def _submit(self, request: EngineCoreRequest) -> None:
        await self.global_scheduler.submit(request)

    async def _abort_core(self, core_ids: list[str]) -> None:
        # Those queued or running elsewhere are aborted there; the rest by this node's engine.
        await super()._abort_core(await self.global_scheduler.abort(core_ids))

    async def _engine_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        # Outputs of requests run for other instances go to them.
        await super()._engine_outputs(await self.global_scheduler.route_outputs(outputs))

    async def abort_client_requests(self, client_request_ids: list[str]) -> None:
        """/abort_requests: every instance's engine aborts the requests whose clients gave these ids,
        and every instance ends its own still queued."""
        self.start()
        self._check_alive()
        await self.global_scheduler.abort_clients(client_request_ids)

    def _fail_all(self, reason: str) -> None:
        super()._fail_all(reason)
        asyncio.get_running_loop().create_task(self.global_scheduler.engine_failed(reason))

    # --- what the global scheduler calls ---------------------------------------------------------
    async def send_core_request(self, request: EngineCoreRequest) -> None:
        """One core request to this node's engine (its own, or one pulled from another's queue)."""
        if request.sampling_params.guided_decoding is not None:
            await self._grammar_vocabulary_sent()
        await self._send(request)
