"""EngineCore: the busy loop's body. schedule -> execute -> update, producing token-level outputs.

It knows token ids only (no tokenizer, no text); front-ends (the offline LLM, the API server)
turn text into requests and outputs back into text. The model runner gets each step as data
(a StepInput, built by step_input_builder.py) and never sees the engine's Request objects.

Two loop bodies, chosen once at start-up as vLLM's `step_fn`: `step` runs each step to the end
before returning; `step_with_overlap` (async scheduling) launches step N+1 before it reads step
N's tokens, so that the host schedules while the device computes.
"""

from __future__ import annotations

import logging
import time

from splitserve import kernels, step_timing
from splitserve.config import EngineConfig
from splitserve.engine import messages, startup
from splitserve.engine.core import pd
from splitserve.engine.core.core_stats import CoreStats
from splitserve.engine.core.expert_stats import ExpertLoadWatch
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.kv_events import attach_events
from splitserve.engine.core.request import Request, RequestStatus
from splitserve.engine.core.schedule_plan import SchedulePlan
from splitserve.engine.core.scheduler import Scheduler
from splitserve.engine.core.sleep_mode import EngineSleep
from splitserve.engine.core.speculation import Speculator
from splitserve.engine.core.step_input_builder import StepInputBuilder
from splitserve.engine.core.structured_output import StructuredOutputManager
from splitserve.engine.lora_registry import LoRARegistry
from splitserve.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from splitserve.executor.abstract import Executor
from splitserve.executor.factory import create_executor
from splitserve.executor.step_input import ModelRunnerOutput
from splitserve.kv_tier.index import make_offload_tier
from splitserve.layers.rotary import is_dynamic_ntk
from splitserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, tokenizer=None):
        """`tokenizer`: the front-end's, for an engine in the same process (structured output needs
        one; an engine process loads its own on the first guided request)."""
        self.config = config
        self._tokenizer = tokenizer
        hf_config = config.model_config.hf_text_config
        # Dynamic NTK rope: prompts longer than this rotate their keys by their own length.
        self._ntk_length = hf_config.max_position_embeddings if is_dynamic_ntk(hf_config) else None
        with startup.phase("weights"):
            self.executor = executor if executor is not None else create_executor(config)
        try:
            self._initialize(config)
        except BaseException:
            self.executor.shutdown()
            raise

    def _initialize(self, config: EngineConfig) -> None:
        num_blocks = self.executor.determine_num_blocks()
        self._check_capacity(num_blocks)
        config.cache_config.num_gpu_blocks = num_blocks
        cc = config.cache_config
        swapping = config.scheduler_config.preemption_mode == "swap"
        cc.num_cpu_blocks = self.executor.determine_num_cpu_blocks() if swapping else 0
        if swapping and cc.num_cpu_blocks < 1:
            raise ValueError("preemption_mode='swap' needs host memory for at least one block: raise --swap-space.")
        offload = make_offload_tier(config, self.executor)  # None without --kv-offloading-size / --kv-cache-dir
        with startup.phase("KV cache"):
            self.executor.initialize_kv_cache(num_blocks, cc.num_cpu_blocks, cc.num_offload_blocks)
        self.expert_load = ExpertLoadWatch(self.executor)  # MoE models: tokens per expert, for /metrics
        self.executor.capture_cuda_graphs()
        self.kv_manager = KVCacheManager(
            num_blocks, cc.block_size, cc.enable_prefix_caching, cc.num_cpu_blocks, offload
        )
        lora_config = config.lora_config
        self.scheduler = Scheduler(config.scheduler_config, self.kv_manager, lora_config and lora_config.max_loras)
        self.loras = LoRARegistry(config, self.executor)
        self.step_inputs = StepInputBuilder(self.kv_manager)
        self.speculator = Speculator(config.speculative_config, config.model_config.max_model_len)
        self.structured_output = StructuredOutputManager(config.model_config, self._tokenizer)
        self._pending_outputs: list[EngineCoreOutput] = []  # outputs of requests that never ran
        self._in_flight: tuple[SchedulePlan, object] | None = None  # launched, not yet finished
        self.step_fn = self.step_with_overlap if config.async_scheduling else self.step
        self.connector = pd.make_connector(self.config, self.executor)  # None unless a PD instance
        self.sleeping = EngineSleep(self)  # sleep mode: engine/core/sleep_mode.py
        self.kv_events = attach_events(self, config.kv_events_config)  # engine/core/kv_events.py; None: off
        self.reporter = CoreStats(self)  # what stats() reports: engine/core/core_stats.py
        if self.config.device.type == "cpu":
            with startup.phase("CPU kernels"):  # built once per machine, loaded from torch's cache after
                kernels.cpu_ops()
        with startup.phase("warm-up"):
            self._warm_up()

    def _warm_up(self) -> None:
        """Run one tiny request through the model: the first forward pays for thread pools and
        kernel selection (over a second on CPU), which would otherwise land on the first user."""
        start = time.perf_counter()
        params = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)
        self.add_request(EngineCoreRequest("splitserve-warmup", list(range(8)), params, None, 2, time.monotonic()))
        while self.has_unfinished_requests():
            self.step_fn()
        self.scheduler.prefix_cache_stats.reset()
        logger.info("Engine warmed up in %.2f s", time.perf_counter() - start)

    def _check_capacity(self, num_blocks: int) -> None:
        capacity = num_blocks * self.config.cache_config.block_size
        max_len = self.config.model_config.max_model_len
        if capacity < max_len:
            raise ValueError(
                f"The KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than max_model_len={max_len}: "
                "one full-length request could never run. Give the cache more memory or lower max_model_len."
            )

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self.sleeping.check_awake()
        if request.kv_transfer is not None and self.connector is None:
            raise ValueError("kv_transfer_params need a prefill or decode instance (--pd-role); this one is mixed.")
        if request.lora_request is not None:
            self.loras.check_request(request.lora_request)
        core_request = Request.from_engine_core_request(request)
        if self._ntk_length is not None and core_request.num_prompt_tokens > self._ntk_length:
            core_request.rope_scaling_len = core_request.num_prompt_tokens
        if core_request.sampling_params.guided_decoding is None:
            self.scheduler.add_request(core_request)
        else:  # the scheduler sees it once its grammar is compiled, off the engine loop
            self.structured_output.admit(core_request)

    def abort_requests(self, request_ids) -> None:
        """Abort requests by id. A prefill instance's leased request (finished, its KV kept for a
        decode instance) gives up its lease: its blocks are freed at the next poll_connector()."""
        request_ids = [rid for rid in request_ids if not self.structured_output.discard(rid)]
        for rid in request_ids:
            if rid in self.scheduler.leased and self.connector is not None:
                self.connector.release_lease(rid)
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.step_inputs.forget(r.request_id for r in finished)

    def abort_client_requests(self, client_request_ids) -> list[str]:
        """Abort the requests whose client gave one of these ids (/abort_requests); returns their ids.
        Leased prefill requests among them give up their lease, as with abort_requests."""
        wanted = set(client_request_ids)
        found = [rid for rid, r in self.scheduler.requests.items() if r.client_request_id in wanted]
        found += [rid for rid, (r, _) in self.structured_output.compiling.items() if r.client_request_id in wanted]
        self.abort_requests(found)
        return found

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or bool(self.structured_output.compiling or self._pending_outputs)
        )

    def _admit_compiled(self) -> None:
        """Guided requests whose grammar is ready join the scheduler."""
        ready, failed = self.structured_output.take_compiled()
        self._pending_outputs += [EngineCoreOutput(rid, [], finish_reason="abort") for rid in failed]
        for request in ready:
            self.scheduler.add_request(request)

    # --- the loop bodies --------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update: one whole step."""
        outputs = self._take_pending_outputs()
        sched = self._schedule()
        if sched is None:
            self._wait_for_grammars()
            return outputs
        handle = self._launch(sched)
        return outputs + self._update(sched, self._collect(handle))

    def step_with_overlap(self) -> list[EngineCoreOutput]:
        """Schedule and launch step N+1, then finish step N while the device computes N+1. A step
        that needs step N's tokens on the host (see _can_overlap) waits for them first; so does every
        step with speculative decoding, whose drafts follow step N's tokens: N+1 is scheduled after
        them, and step N's outputs go to the front-end while the device computes N+1."""
        outputs = self._take_pending_outputs()
        if self.speculator.enabled and self._in_flight is not None:
            outputs += self._finish_in_flight()
        sched = self._schedule()
        if sched is not None and self._in_flight is not None and not self._can_overlap(sched):
            outputs += self._finish_in_flight()
            sched = self._drop_finished(sched)
        launched = (sched, self._launch(sched)) if sched is not None else None
        if launched is None and self._in_flight is None:
            self._wait_for_grammars()
        if self._in_flight is not None:
            outputs += self._finish_in_flight()
        self._in_flight = launched
        if launched is not None and self._in_flight_is_moot():
            outputs += self._finish_in_flight()
        return outputs

    def _in_flight_is_moot(self) -> bool:
        """Every request of the step in flight has finished since it was launched: nothing will use
        its tokens, so finish it now rather than leave the engine looking busy."""
        return all(r.is_finished() for r, _ in self._in_flight[0].scheduled)

    def _wait_for_grammars(self) -> None:
        """Nothing can run until a grammar is compiled: wait for one (briefly, so that new requests
        and aborts are still read) instead of spinning, which would starve the compiling thread."""
        if self.structured_output.compiling and self._in_flight is None:
            self.structured_output.wait_for_any(timeout=0.05)

    def _take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _schedule(self) -> SchedulePlan | None:
        if self.structured_output.compiling:
            self._admit_compiled()
        if not self.scheduler.has_unfinished_requests():
            return None
        sched = self.scheduler.schedule()
        for request in sched.expired:
            ttl = self.config.scheduler_config.waiting_ttl
            self._pending_outputs.append(messages.queue_ttl_expired(request.request_id, ttl))
        if sched.kv_pulls:  # the offloading tier's copies go to the ranks before the pulls, not with the step
            offload_ops, sched.kv_offload = sched.kv_offload, None
            self.connector.submit_pulls(sched.kv_pulls, offload_ops)
        step_timing.lap("scheduling")
        return None if sched.is_empty else sched

    @staticmethod
    def _drop_finished(sched: SchedulePlan) -> SchedulePlan | None:
        """Requests that the step just finished stopped have no blocks any more: they must not run."""
        sched.scheduled = [(r, n) for r, n in sched.scheduled if not r.is_finished()]
        return None if sched.is_empty else sched

    @staticmethod
    def _can_overlap(sched: SchedulePlan) -> bool:
        """A request whose last token is still being sampled can run only if its sampling does not
        read its output tokens on the host (penalties, bad words, min_tokens)."""
        return not any(r.num_pending_tokens and r.reads_output_history for r, _ in sched.scheduled)

    def _launch(self, sched: SchedulePlan) -> object:
        now = time.monotonic()
        for request, _ in sched.scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        step_input = self.step_inputs.build(sched)
        step_input.grammar_bitmasks = self._grammar_bitmasks(sched, step_input)
        step_timing.lap("step input")
        handle = self.executor.launch(step_input)
        self.scheduler.advance(sched)
        step_timing.lap("scheduling")
        return handle

    def _collect(self, handle) -> ModelRunnerOutput:
        result = self.executor.collect(handle)
        step_timing.lap("waiting for the device")
        return result

    def _grammar_bitmasks(self, sched: SchedulePlan, step_input) -> dict[str, bytes]:
        """The next-token bitmask of every guided request that samples in this step."""
        sampling = {row.request_id for row in step_input.scheduled if row.samples}
        guided = [r for r, _ in sched.scheduled if r.grammar is not None and r.request_id in sampling]
        return self.structured_output.fill_bitmasks(guided, sched.spec_tokens)

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        sched, handle = self._in_flight
        self._in_flight = None
        return self._update(sched, self._collect(handle))

    def _update(self, sched: SchedulePlan, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Record a finished step's tokens in its requests and turn them into outputs."""
        updated = self.scheduler.record_samples(sched, self.speculator.new_tokens(sched, result))
        self._advance_grammars(updated)
        outputs = {r.request_id: self._output(r, result) for r in updated}
        for rid, entries in result.prompt_logprobs.items():
            outputs.setdefault(rid, EngineCoreOutput(rid, [])).new_prompt_logprobs = entries
        finished = [r for r in updated if r.is_finished()]
        for request in finished if self.scheduler.leased else ():
            if request.request_id in self.scheduler.leased:
                outputs[request.request_id].kv_transfer = pd.lease(
                    self.connector, request, self.kv_manager, outputs[request.request_id]
                )
        for request in finished:
            self.speculator.finish(request)
        self.step_inputs.forget(r.request_id for r in finished)
        self.speculator.propose(self.scheduler.running, result.draft_token_ids)
        step_timing.lap("update")
        step_timing.count_step(len(sched.scheduled))
        return list(outputs.values())

    def _advance_grammars(self, updated: list[Request]) -> None:
        ended = self.structured_output.advance(updated)
        if ended:
            self.scheduler.finish_requests(ended, RequestStatus.FINISHED_STOPPED)

    # --- prefill/decode disaggregation ---------------------------------------------------------
    def poll_connector(self) -> None:
        """Free the blocks of leases that ended, and let requests whose KV arrived run (engine/core/pd.py).
        The busy loop calls it once per iteration, busy or idle (leases expire while nothing runs)."""
        if self.connector is not None:
            self._pending_outputs += pd.poll(self.connector, self.scheduler, self.step_inputs)

    def _output(self, request: Request, result) -> EngineCoreOutput:
        rid = request.request_id
        top_logprobs, token_logprobs = self.speculator.logprobs(request, result)
        return EngineCoreOutput(
            request_id=rid,
            new_token_ids=request.new_token_ids,  # a new list each step (record_samples): shared, not copied
            new_logprobs=top_logprobs,
            new_token_logprobs=token_logprobs,
            new_prompt_logprobs=result.prompt_logprobs.get(rid),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time if request.is_finished() else None,
            pooled=result.pooled.get(rid),
        )

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        try:
            if logger.isEnabledFor(logging.DEBUG):
                for layer, counts in self.executor.expert_load().items():
                    logger.debug("MoE layer %d: tokens routed to each expert since start: %s", layer, counts)
            if self.connector is not None:
                self.connector.shutdown()
            if self.kv_events is not None:
                self.kv_events.shutdown()
        except Exception as exc:  # a dead rank cannot stop its connector; stop the ranks regardless
            logger.warning("KV connector shutdown failed: %s", exc)
        finally:
            self.executor.shutdown()

    def stats(self) -> SchedulerStats:
        return self.reporter.snapshot()
