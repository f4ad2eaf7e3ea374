"""The EngineCore in its own process: a busy loop around a ZMQ ROUTER socket.

Clients (API server workers) connect DEALER sockets to one IPC path. Each loop iteration drains
the socket without blocking (adds, aborts, pings), runs one engine step, and sends each client the
outputs of its own requests together with the scheduler's state. When there is nothing to run the
loop blocks on the socket instead of spinning. The time spent on messaging is measured and logged,
so that its cost next to the model step stays visible.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import defaultdict

import msgspec
import zmq

from splitserve import envs
from splitserve.config import EngineConfig
from splitserve.engine import startup
from splitserve.engine.core.memtrace import MemoryTrace
from splitserve.engine.core.watchdog import StepWatchdog
from splitserve.engine.core.weight_update import update_weights
from splitserve.engine.errors import EngineAsleepError
from splitserve.engine.messages import (
    AbortClientRequests,
    AbortRequests,
    ClientMessage,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    GrammarVocabulary,
    LoRACall,
    Ping,
    SchedulerStats,
    SleepCall,
    SleepReply,
)
from splitserve.process_utils import exit_with_parent, set_process_name

logger = logging.getLogger(__name__)

_STATS_INTERVAL_S = 0.5  # idle clients still hear the engine's state this often
_LOG_INTERVAL_S = 10.0


class EngineCoreProc:
    def __init__(self, config: EngineConfig, address: str):
        from splitserve.engine.core.engine_core import EngineCore

        self.core = EngineCore(config)
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self.owner: dict[str, bytes] = {}  # core request id -> client identity
        self.clients: set[bytes] = set()
        self.last_stats = 0.0
        self.ipc_seconds = 0.0
        self.step_seconds = 0.0
        self.steps = 0
        self.last_log = time.monotonic()
        self.watchdog = StepWatchdog(config.health_timeout, self._describe)
        self._audit: tuple[tuple, int] | None = None  # (what the engine held, blocks held) at the last audit
        self.memtrace = MemoryTrace.from_env()

    def run(self) -> None:
        while True:
            busy = self.core.has_unfinished_requests()
            start = time.perf_counter()
            self._drain(block=not busy)
            if not busy:
                self.core.executor.check_health()  # a rank that died while idle fails the engine now
            self.core.poll_connector()
            mid = time.perf_counter()
            outputs = self._step() if self.core.has_unfinished_requests() else []
            end = time.perf_counter()
            self._send(outputs, force_stats=busy and not self.core.has_unfinished_requests())
            self.ipc_seconds += (mid - start if busy else 0.0) + time.perf_counter() - end
            if outputs or busy:
                self.steps += 1
                self.step_seconds += end - mid
            self._maybe_log()
            if self.memtrace is not None:
                self.memtrace.maybe_report()

    def _step(self) -> list:
        self.watchdog.begin()
        try:
            return self.core.step_fn()
        finally:
            self.watchdog.end()

    def _describe(self) -> str:
        """What the engine holds, for the watchdog's report (read from another thread: approximate)."""
        sched = self.core.scheduler
        running = [r.request_id for r in list(sched.running)[:8]]
        return (
            f"{len(sched.running) + len(sched.waiting)} request(s), {len(sched.running)} running "
            f"(first: {', '.join(running) or 'none'}) and {len(sched.waiting)} waiting, "
            f"KV cache {100 * self.core.kv_manager.usage:.0f}% used"
        )

    # --- input ------------------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        if block:
            self.socket.poll(timeout=int(_STATS_INTERVAL_S * 1000))
        while True:
            try:
                identity, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.clients.add(identity)
            self._handle(identity, self.decoder.decode(payload))

    def _handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, EngineCoreRequest):
            self.owner[msg.request_id] = identity
            try:
                self.core.add_request(msg)
            except (ValueError, KeyError) as exc:  # e.g. an adapter removed since the client looked
                logger.warning("Request %s refused: %s", msg.request_id, exc)
                refusal = EngineCoreOutput(
                    msg.request_id,
                    [],
                    finish_reason="abort",
                    error=str(exc),
                    error_not_found=isinstance(exc, KeyError),
                    error_status=503 if isinstance(exc, EngineAsleepError) else 0,
                )
                self._send_to(identity, EngineCoreOutputs([refusal]))
                del self.owner[msg.request_id]
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids)
            for rid in msg.request_ids:
                self.owner.pop(rid, None)
        elif isinstance(msg, AbortClientRequests):
            for rid in self.core.abort_client_requests(msg.client_request_ids):
                owner = self.owner.pop(rid, None)
                if owner is not None:  # its front-end did not ask: tell it that the request ended
                    self._send_to(owner, EngineCoreOutputs([EngineCoreOutput(rid, [], finish_reason="abort")]))
        elif isinstance(msg, SleepCall):
            self._send_to(identity, EngineCoreOutputs(stats=self._stats(), sleep_reply=self._sleep_call(msg)))
        elif isinstance(msg, Ping):
            self._send_to(identity, EngineCoreOutputs(stats=self._stats(), pong=msg.nonce))
        elif isinstance(msg, LoRACall):
            reply = self.core.loras.call(msg)
            self._send_to(identity, EngineCoreOutputs(stats=self._stats(), lora_reply=reply))
            self.last_stats = 0.0  # every client hears the new registry version at the next send
        elif isinstance(msg, GrammarVocabulary):
            self.core.structured_output.set_tokenizer_info(msg.tokenizer_info)

    def _sleep_call(self, call: SleepCall) -> SleepReply:
        sleeping = self.core.sleeping
        try:
            if call.op == "sleep":
                sleeping.sleep(call.level)
            elif call.op == "wake_up":
                sleeping.wake_up()
            elif call.op == "update_weights":
                update_weights(self.core, call.model_path, call.load_format)
            elif call.op == "reset_prefix_cache":
                if not sleeping.reset_prefix_cache():
                    raise ValueError("Requests hold KV blocks: the prefix cache can be reset only when none run.")
            elif call.op != "is_sleeping":
                raise ValueError(f"unknown sleep call {call.op!r}")
        except ValueError as exc:
            return SleepReply(call.call_id, sleeping.level, str(exc))
        return SleepReply(call.call_id, sleeping.level)

    # --- output -----------------------------------------------------------------------------
    def _stats(self) -> SchedulerStats:
        stats = self.core.stats()
        stats.taken_at = time.time()
        if not self.core.has_unfinished_requests():
            stats.kv_blocks_held = self._audit_kv()
        return stats

    def _audit_kv(self) -> int:
        """The KV blocks requests hold (on an idle engine: only leases), counted block by block after
        the scheduler's and block pool's invariant checks; a failed check raises, which stops the
        engine with its message. It walks every block, so it runs again only when the engine has
        stepped, or its requests or free blocks changed, since the last audit."""
        core = self.core
        state = (self.watchdog.step, len(core.scheduler.requests), core.kv_manager.pool.num_free_blocks)
        if self._audit is None or self._audit[0] != state:
            core.scheduler.check_invariants()
            self._audit = (state, core.kv_manager.num_held_blocks())
        return self._audit[1]

    def _send(self, outputs: list[EngineCoreOutput], force_stats: bool) -> None:
        by_client: dict[bytes, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            identity = self.owner.get(out.request_id)
            if identity is None:
                continue  # aborted by its client while the step ran
            by_client[identity].append(out)
            if out.finished:
                del self.owner[out.request_id]
        now = time.monotonic()
        broadcast = force_stats or now - self.last_stats >= _STATS_INTERVAL_S
        if not by_client and not broadcast:
            return
        stats = self._stats()
        for identity in self.clients if broadcast else by_client:
            self._send_to(identity, EngineCoreOutputs(by_client.get(identity, []), stats))
        if broadcast:
            self.last_stats = now

    def _send_to(self, identity: bytes, message: EngineCoreOutputs) -> None:
        try:
            self.socket.send_multipart([identity, self.encoder.encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("Client %r is not reading its outputs; dropped one message", identity)

    def broadcast_dead(self, reason: str) -> None:
        for identity in self.clients:
            self._send_to(identity, EngineCoreOutputs(engine_dead=reason))

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last_log < _LOG_INTERVAL_S or not self.steps:
            return
        s = self.core.stats()
        logger.info(
            "Engine: %d steps in the last %.0f s, %.1f ms/step model, %.0f us/step messaging (%.2f%%); "
            "running %d, waiting %d, KV cache %.1f%% used",
            self.steps,
            now - self.last_log,
            1e3 * self.step_seconds / self.steps,
            1e6 * self.ipc_seconds / self.steps,
            100 * self.ipc_seconds / max(self.step_seconds, 1e-9),
            s.num_running,
            s.num_waiting,
            100 * s.kv_cache_usage,
        )
        if s.spec_decoding is not None:
            logger.info("Speculative decoding: %s", s.spec_decoding.describe())
        self.steps, self.step_seconds, self.ipc_seconds, self.last_log = 0, 0.0, 0.0, now


def run_engine_core(source, address: str, ready_pipe, forked_from_server: bool = False) -> None:
    """Entry point of the engine process (through engine_process.EngineProcess): build the core,
    report readiness, loop until killed. `source` is an EngineConfig, or a DeferredEngineConfig
    that builds one here."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    exit_with_parent()
    set_process_name("splitserve-eng")
    logging.basicConfig(  # force: a forked engine inherits its server's handler, with the server's format
        level=envs.SPLITSERVE_LOGGING_LEVEL.upper(), format="%(asctime)s %(levelname)s engine: %(message)s", force=True
    )
    try:
        config = source if isinstance(source, EngineConfig) else source.build()
    except Exception as exc:  # bad arguments: the parent, building its own copy, reports them itself
        ready_pipe.send({"status": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return
    try:
        from splitserve.executor.cpu_binding import configure_cpu_threads, one_core_left_to_the_server

        single_rank = config.parallel_config.world_size == 1  # with several ranks, the workers take the cores
        if single_rank:
            configure_cpu_threads()
        with one_core_left_to_the_server(forked_from_server and single_rank):  # (forked: on the CPU)
            proc = EngineCoreProc(config, address)
    except Exception as exc:  # report any start-up failure to the parent, then exit
        if isinstance(exc, ValueError):  # a setting refused, in words: no traceback to read past
            logger.error("Engine start-up refused: %s", exc)
        else:
            logger.exception("Engine start-up failed")
        ready_pipe.send({"status": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return
    signal.signal(signal.SIGTERM, lambda *_: _stop_ranks_and_exit(proc))
    startup.report("engine")
    ready_pipe.send({"status": "ready", "num_gpu_blocks": config.cache_config.num_gpu_blocks})
    try:
        proc.run()
    except Exception as exc:
        logger.exception("Engine core died")
        proc.broadcast_dead(f"{type(exc).__name__}: {exc}")
        raise


def _stop_ranks_and_exit(proc: EngineCoreProc) -> None:
    """SIGTERM once the engine runs: stop the rank processes (mp, Ray) here, where they were started,
    rather than leave it to their parent-death signal alone; then exit at once, as during start-up."""
    try:
        proc.core.executor.shutdown()
    finally:
        os._exit(0)
