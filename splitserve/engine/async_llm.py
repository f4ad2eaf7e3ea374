"""AsyncLLM: the front-end an API server worker uses to talk to the engine core process.

Requests come processed (the API server runs the Processor in a worker thread, so that a long
prompt does not stall the event loop) and go out over a ZMQ DEALER socket; one asyncio task reads
the core's outputs, detokenizes them and hands each RequestOutput to the queue of the request it
belongs to. If the engine process dies, every pending request fails at once with EngineDeadError;
when the server restarts its engine (engine/supervisor.py: the EngineWatch says so), this front-end
connects to the new one and serves again.

The calls it makes of the engine (LoRA adapters, sleep mode, weight updates) are its mixin EngineCalls'
(engine/engine_calls.py). Under the global scheduler the API worker's front-end is its subclass
GlobalSchedulerAsyncLLM (engine/global_frontend.py), which sends requests, aborts and outputs through
Redis; _submit, _abort_core and _engine_outputs are where it does so.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from splitserve.config import ModelConfig
from splitserve.engine.engine_calls import EngineCalls
from splitserve.engine.errors import EngineDeadError
from splitserve.engine.frontend import FrontEnd
from splitserve.engine.messages import (
    AbortClientRequests,
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    GrammarVocabulary,
    KVTransferParams,
    Ping,
    SchedulerStats,
)
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.engine.processor import ProcessedRequest
from splitserve.engine.supervisor import EngineWatch
from splitserve.lora.request import LoRARequest
from splitserve.outputs import RequestOutput
from splitserve.process_utils import process_alive

logger = logging.getLogger(__name__)

_LIVENESS_CHECK_S = 0.25  # how long the engine may be silent before its process is looked at
_PING_WAIT_S = 1.0  # how long a health check waits for an engine that has been silent


class AsyncLLM(FrontEnd, EngineCalls):
    def __init__(
        self,
        model_config: ModelConfig,
        engine_address: str,
        engine_pid: int,
        client_index: int = 0,
        engine_watch: EngineWatch | None = None,
        tokenizer=None,  # one already loaded (data-parallel replicas share one)
    ):
        super().__init__(model_config, tokenizer)
        self._engine_pid = engine_pid
        self.engine_address = engine_address
        self.engine_watch = engine_watch  # None: no one restarts the engine
        self.generation = engine_watch.generation if engine_watch is not None else 0
        self.client_index = client_index
        self.socket = self._connect()
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats: SchedulerStats | None = None
        self.sent_since_stats = 0
        self.dead_reason: str | None = None
        self.last_heard = 0.0  # when the engine last sent anything (time.monotonic)
        self.on_stats = None  # callback(SchedulerStats), set by the metrics layer
        self._output_task: asyncio.Task | None = None
        self._pings: dict[int, asyncio.Future] = {}
        self._vocabulary_task: asyncio.Future | None = None
        self._nonce = itertools.count()  # ping ids
        self._init_calls()  # LoRA and sleep calls (engine/engine_calls.py)

    def set_inter_token_hook(self, hook) -> None:
        """hook(seconds) for each gap between a request's outputs (the metrics' inter-token latency)."""
        self.output_processor.on_inter_token = hook

    def _connect(self) -> zmq.asyncio.Socket:
        socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, f"api-{self.client_index}-{os.getpid()}".encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.engine_address)
        return socket

    @property
    def engine_pid(self) -> int:
        return self.engine_watch.pid if self.engine_watch is not None else self._engine_pid

    # --- requests ---------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        request: ProcessedRequest,
        arrival_time: float | None = None,
        kind: RequestOutputKind = RequestOutputKind.DELTA,
        kv_transfer: KVTransferParams | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """A processed request's outputs as they come (DELTA: what is new each time; FINAL_ONLY: one
        output). Closing the iterator early, or cancelling the task iterating it, aborts the request."""
        self.start()
        await self._caught_up()
        self._check_alive()
        core_requests = self.prepare_request(
            request_id, request, kind, arrival_time, kv_transfer, lora_request, priority
        )
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False
        try:
            if request.params.guided_decoding is not None:
                await self._grammar_vocabulary_sent()
            for core_request in core_requests:
                await self._submit(core_request)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                await self.abort([request_id])

    async def _grammar_vocabulary_sent(self) -> None:
        """Once, before this front-end's first guided request (see GrammarVocabulary); guided requests
        that arrive meanwhile wait for it, so that none reaches the engine first."""
        if self._vocabulary_task is None:
            self._vocabulary_task = asyncio.ensure_future(self._send_grammar_vocabulary())
        await asyncio.shield(self._vocabulary_task)

    async def _send_grammar_vocabulary(self) -> None:
        info = await asyncio.to_thread(lambda: self.processor.guides.info.serialize_json())
        await self._send(GrammarVocabulary(info))

    async def abort(self, request_ids: list[str]) -> None:
        await self._abort_core(self.output_processor.abort(request_ids))

    # What GlobalSchedulerAsyncLLM (engine/global_frontend.py) does otherwise: where a new core request
    # goes, how core requests are aborted, and where the engine's outputs go.
    async def _submit(self, request: EngineCoreRequest) -> None:
        await self._send(request)

    async def _abort_core(self, core_ids: list[str]) -> None:
        await self.abort_core_requests(core_ids)

    async def _engine_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        await self.deliver(outputs)

    async def abort_core_requests(self, core_ids: list[str]) -> None:
        """Abort these requests of the engine by their engine ids."""
        if core_ids and self.dead_reason is None:
            await self._send(AbortRequests(core_ids))

    async def abort_client_requests(self, client_request_ids: list[str]) -> None:
        """/abort_requests, from any API worker: the engine aborts the requests whose clients gave these
        ids; their workers see finish_reason "abort"."""
        self.start()
        self._check_alive()
        await self.abort_engine_client_requests(client_request_ids)

    async def abort_engine_client_requests(self, client_request_ids: list[str]) -> None:
        await self._send(AbortClientRequests(list(client_request_ids)))

    async def release_kv_leases(self, core_request_ids: list[str]) -> None:
        """PD prefill side: end the KV leases of these finished requests (engine ids, as the
        kv_transfer_params' remote_request_id names them) so that their blocks are freed now."""
        self.start()
        self._check_alive()
        await self._send(AbortRequests(core_request_ids))

    def try_reserve_queue_slot(self, limit: int) -> bool:
        """Admission control: True (and count the request as queued) while fewer than `limit`
        requests wait in the engine, as last reported, plus those this worker admitted since that
        report. Checking and counting happen together, so a burst of requests cannot all pass."""
        queued = (self.stats.num_waiting if self.stats else 0) + self.sent_since_stats
        if queued >= limit:
            return False
        self.sent_since_stats += 1
        return True

    async def check_health(self, timeout: float) -> bool:
        """True when the engine process is alive and has spoken within `timeout` seconds, or answers
        a ping at once. The engine speaks after every step and every half second when idle, so one
        silent for `timeout` is stuck in a step (its watchdog logs where) unless a ping proves
        otherwise within a second: /health turns 503 at most a second after `timeout` of silence."""
        self.start()
        if self.dead_reason is not None or not process_alive(self.engine_pid):
            return False
        if time.monotonic() - self.last_heard < timeout:
            return True
        nonce = next(self._nonce)
        future = asyncio.get_running_loop().create_future()
        self._pings[nonce] = future
        try:
            await self._send(Ping(nonce))
            await asyncio.wait_for(future, min(timeout, _PING_WAIT_S))
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._pings.pop(nonce, None)

    async def _send(self, message) -> None:
        if self.socket.closed:  # between an engine's death and its successor
            raise EngineDeadError(f"The engine is restarting after it failed ({self.dead_reason}).")
        await self.socket.send(self.encoder.encode(message))

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            if self.engine_watch is not None:
                raise EngineDeadError(
                    f"The engine is restarting after it failed ({self.dead_reason}); retry in a few seconds."
                )
            raise EngineDeadError(f"The engine is not running: {self.dead_reason}")

    # --- outputs ----------------------------------------------------------------------------
    def start(self) -> None:
        """Read the engine's outputs, in the running loop."""
        if self._output_task is None:
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        try:
            while True:
                ready = await self.socket.poll(timeout=int(_LIVENESS_CHECK_S * 1000))
                if self._replaced():  # restarted before this front-end noticed the death
                    self._fail_all("the engine process was restarted")
                elif not ready and not process_alive(self.engine_pid):
                    self._fail_all("the engine process exited")
                elif not ready:
                    continue
                else:
                    message = self.decoder.decode(await self.socket.recv())
                    self.last_heard = time.monotonic()
                    if message.engine_dead is None:
                        await self._handle(message)
                        continue
                    self._fail_all(message.engine_dead)
                if not await self._await_new_engine():
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave requests hanging forever
            logger.exception("Output handling failed")
            self._fail_all(f"output handling failed: {exc}")

    async def _caught_up(self) -> None:
        """Before a new request or call: when the supervisor has already restarted the engine but the
        output loop has not switched to it yet (it looks every _LIVENESS_CHECK_S), wait for the switch;
        sent now, the request would go to the old socket and be failed with the dead engine's requests."""
        while self._replaced() and self._output_task is not None and not self._output_task.done():
            await asyncio.sleep(0.01)

    def _replaced(self) -> bool:
        return self.engine_watch is not None and self.engine_watch.generation != self.generation

    async def _await_new_engine(self) -> bool:
        """After the engine died: wait until the server's supervisor has a new one ready, then talk to
        it on a new socket. False when no one restarts it."""
        if self.engine_watch is None:
            return False
        # Closed at once, dropping what was sent to the dead engine: a socket that connects reconnects
        # by itself and would deliver those messages (a request its client already got a 503 for) to
        # the new engine, which binds the same address.
        self.socket.close()
        while not self._replaced():
            await asyncio.sleep(0.05)
        self.socket = self._connect()
        self.generation = self.engine_watch.generation
        self.stats, self.sent_since_stats, self.last_heard = None, 0, 0.0
        self._vocabulary_task = None  # the new engine needs the grammar vocabulary again
        self.dead_reason = None
        logger.info("Connected to the restarted engine (pid %d)", self.engine_pid)
        self._new_engine_loras()
        return True

    async def _handle(self, message: EngineCoreOutputs) -> None:
        self._answer_calls(message)  # answers to lora_call / sleep_call
        if message.stats is not None:
            self.stats, self.sent_since_stats = message.stats, 0
            if self.on_stats is not None:
                self.on_stats(message.stats)
        if message.pong is not None and message.pong in self._pings:
            self._pings[message.pong].set_result(True)
        if message.outputs:
            await self._engine_outputs(message.outputs)

    async def deliver(self, core_outputs: list[EngineCoreOutput]) -> None:
        """Core outputs of this front-end's requests (from its engine, or under the global scheduler from
        the instance running one for it) to the requests' queues."""
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            await self._abort_core(stopped)
        for output in outputs:
            queue = self.queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        if self.queues:  # else a server stopping with its engine, or an idle death its supervisor reports
            logger.error("Engine is dead (%s): failing %d pending requests", reason, len(self.queues))
        for queue in self.queues.values():
            queue.put_nowait(EngineDeadError(f"The engine is not running: {reason}"))
        self._fail_calls(reason)
        self.output_processor.abort(list(self.output_processor.requests))

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        self.socket.close()
