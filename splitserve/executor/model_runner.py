"""The model runner: owns the model, the paged KV cache tensors and the sampler, and turns one
StepInput (the data-only step the engine sends) into one forward pass plus sampling."""

from __future__ import annotations

import logging

import numpy as np
import torch

from splitserve import envs, step_timing
from splitserve.config import EngineConfig
from splitserve.distributed import get_parallel_rank, pp_recv, pp_send
from splitserve.executor.attention import AttentionMetadata, get_attention_backend
from splitserve.executor.cpu_decode_stack import CPUDecodeStack
from splitserve.executor.cuda_graph import CUDAGraphRunner, capture_sizes
from splitserve.executor.encoder_cache import EncoderCache
from splitserve.executor.gpu_memory import run_largest_step
from splitserve.executor.host import StepReady, move, start_host_copy, to_device
from splitserve.executor.in_flight import InFlightStep, collect_pooled, collect_samples
from splitserve.executor.input_batch import CachedRequestState, InputBatch
from splitserve.executor.kv_swap import HostKVSwap
from splitserve.executor.mrope import remember_prompt_positions, step_positions
from splitserve.executor.persistent_batch import PersistentBatch
from splitserve.executor.pooler import pool_step
from splitserve.executor.prompt_logprobs import prompt_logprobs
from splitserve.executor.runner_kv_cache import RunnerKVCache
from splitserve.executor.sampler import Sampler, apply_token_bitmask
from splitserve.executor.sampling_metadata import build_sampling_metadata
from splitserve.executor.step_input import ModelRunnerOutput, ScheduledRequest, StepInput
from splitserve.kernels import batch_invariant, cpu_memory
from splitserve.kv_tier.copier import KVOffloadCopier
from splitserve.layers.moe import FusedMoE, expert_load, moe_capturable
from splitserve.layers.rotary import is_dynamic_ntk
from splitserve.loader.weights import load_model
from splitserve.quantization.kv_cache import kv_cache_spec

logger = logging.getLogger(__name__)


class ModelRunner(RunnerKVCache):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.device
        self.block_size = config.cache_config.block_size
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches, CUDA graphs and events use the current device: make it this one.
            torch.cuda.set_device(self.device)
        if self.device.type == "cuda" and envs.SPLITSERVE_CUDA_SYNC_DEBUG:
            torch.cuda.set_sync_debug_mode(envs.SPLITSERVE_CUDA_SYNC_DEBUG)  # names every host stall
        torch.manual_seed(config.model_config.seed)
        if self.device.type == "cpu":
            cpu_memory.tune_for_activations()
        self.rank = get_parallel_rank()
        self.model = load_model(config.model_config, self.device, config.use_tqdm_on_load and self.rank.rank == 0)
        self.is_moe = any(isinstance(m, FusedMoE) for m in self.model.modules())
        if config.batch_invariant:
            if self.is_moe:
                raise ValueError(
                    "--batch-invariant does not cover mixture-of-experts layers yet: an expert's products run on "
                    "the tokens routed to it, whose number changes with the batch (docs/determinism.md)."
                )
            batch_invariant.enable(self.model, self.device)
        self.backend = get_attention_backend(self.device, config.cache_config.cache_dtype)
        self.uses_rope_lengths = is_dynamic_ntk(config.model_config.hf_text_config)  # AttentionMetadata.rope_lengths
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}  # the runner's own view of each live request
        self.persistent = PersistentBatch(self.block_size)  # their rows, kept between steps
        self.kv_spec = kv_cache_spec(config.cache_config.cache_dtype, config.model_config.dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: list[torch.Tensor] | None = None  # per layer, with a quantized cache only
        self.graph_runner: CUDAGraphRunner | None = None
        self.swap: HostKVSwap | None = None  # host memory for swapped-out KV (preemption_mode "swap")
        self.offload: KVOffloadCopier | None = None  # the KV offloading tier's host memory and files
        self.decode_stack: CPUDecodeStack | None = None  # CPU steps in one C++ call, once the KV is bound
        self.lora_manager = self._lora_manager()
        self.draft = self._draft_proposer()
        # A vision-language model's image embeddings, on the stage that embeds the prompt's tokens.
        multimodal = config.model_config.is_multimodal and self.rank.is_first_stage
        self.encoder_cache = EncoderCache(self.device) if multimodal else None
        self.uses_mrope = hasattr(self.model, "mrope_positions")  # Qwen2-VL's rope positions (executor/mrope.py)
        self.use_cuda_graphs = self._use_cuda_graphs()
        self.num_steps = 0

    def _use_cuda_graphs(self) -> bool:
        if self.device.type != "cuda":
            return False
        if self.rank.pp_size > 1:
            logger.info("CUDA graphs are off: pipeline stages hand activations to each other between layers.")
            return False
        if self.lora_manager is not None:
            logger.info("CUDA graphs are off: LoRA adapters change from step to step.")
            return False
        if self.config.enforce_eager:
            logger.info("CUDA graphs are off (--enforce-eager): every step launches its kernels one by one.")
            return False
        if not moe_capturable(self.model, self.device, self.config.model_config.dtype):
            logger.info(
                "CUDA graphs are off: the mixture-of-experts layers run expert by expert, reading each expert's "
                "token count on the host every step (docs/moe.md: quantized experts, expert parallelism, "
                "SPLITSERVE_MOE_BACKEND=loop)."
            )
            return False
        if not self.backend.supports_cuda_graphs:
            logger.info("CUDA graphs are off: the %s attention backend cannot be captured.", self.backend.name)
            return False
        return True

    def _draft_proposer(self):
        if self.config.draft_model_config is None:
            return None
        from splitserve.executor.draft_model import DraftModelProposer

        show = self.config.use_tqdm_on_load and self.rank.rank == 0
        return DraftModelProposer(self.config, self.device, self.backend, self.rank, show)

    def _lora_manager(self):
        if self.config.lora_config is None:
            return None
        if self.is_moe:
            raise ValueError(
                "LoRA adapters on mixture-of-experts models are not supported yet: their experts are not LoRA "
                "targets. Serve the model without --enable-lora."
            )
        from splitserve.executor.lora_manager import LoRAManager

        mc = self.config.model_config
        return LoRAManager(self.model, mc.hf_text_config, self.config.lora_config, self.device, mc.dtype)

    def add_lora(self, lora) -> None:
        self.lora_manager.add_adapter(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        self.lora_manager.remove_adapter(lora_int_id)

    def expert_load(self) -> dict[int, list[int]]:
        return expert_load(self.model)

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture the decode forwards (after initialize_kv_cache); nothing without CUDA graphs."""
        if not self.use_cuda_graphs:
            return
        sc, pad_block = self.config.scheduler_config, self.kv_caches[0].shape[2] - 1
        sizes, max_len = capture_sizes(self.config.cuda_graph_sizes, sc.max_num_seqs), sc.max_model_len
        self.graph_runner = CUDAGraphRunner(
            self.model, self.backend, sizes, max_len, self.block_size, pad_block, self.device, self.uses_rope_lengths
        )
        self.graph_runner.capture_all()

    def profile_run(self) -> tuple[int, int]:
        """The largest step the scheduler can make, on dummy tokens (gpu_memory.run_largest_step)."""
        return run_largest_step(self)

    # --- requests ---------------------------------------------------------------------------
    def _update_states(self, step: StepInput) -> list[tuple[CachedRequestState, ScheduledRequest]]:
        """Forget finished requests, learn new ones, and take in each scheduled request's news."""
        for request_id in step.finished_request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self.persistent.remove(state)
        for data in step.new_requests:
            state = self.requests[data.request_id] = CachedRequestState.from_new(data)
            self.persistent.add(state)
            if self.uses_mrope:
                remember_prompt_positions(self.model, state)
        rows = []
        for scheduled in step.scheduled:
            state = self.requests[scheduled.request_id]
            if scheduled.new_block_ids or scheduled.resumed or state.records_outputs:  # else: no news
                state.update(scheduled)
                self.persistent.update_blocks(state, scheduled)
            rows.append((state, scheduled))
        return rows

    def _input_batch(self, rows: list[tuple[CachedRequestState, ScheduledRequest]]) -> InputBatch:
        if self.persistent.takes(rows):
            return self.persistent.decode_step(rows)
        return InputBatch.build(rows, self.block_size)

    # --- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, step_input: StepInput, previous: InFlightStep | None = None) -> InFlightStep:
        """Queue one step's forward and sampling on the device and return without waiting for it.
        A request whose last token is still being sampled by `previous` (overlap scheduling) gets
        it from previous.sampled.token_ids on the device. collect() reads the result."""
        if self.swap is not None:
            self.swap.apply(step_input.swap_out, step_input.swap_in)
        if step_input.kv_offload is not None:
            self.offload.apply(step_input.kv_offload)
        if self.draft is not None:
            self.draft.observe(step_input)
        if not step_input.scheduled:  # a step that only moved blocks to or from host memory
            self._update_states(step_input)
            return InFlightStep([], [], ready=StepReady(self.device))
        batch = self._input_batch(self._update_states(step_input))
        self.num_steps += 1
        if self.lora_manager is not None:
            self.lora_manager.prepare([r.lora_request for r in batch.requests], batch.query_start_loc, self.num_steps)
        if self._replays(batch):  # a decode step in a captured graph: inputs straight into its buffers
            size = self._stage_for_graph(batch, previous)
            step_timing.lap("input preparation")
            hidden = self.graph_runner.replay(size, len(batch.requests))
        else:
            meta = self._attention_metadata(batch)
            input_ids = self._input_ids(batch, previous)
            positions = self._positions(batch)
            step_timing.lap("input preparation")
            if batch.mm_spans and self.encoder_cache is not None:  # images: the step starts from embeddings
                embeds = self.encoder_cache.inputs_embeds(self.model, input_ids, batch.mm_spans)
                hidden = self._forward(input_ids, positions, meta, inputs_embeds=embeds)
            else:
                hidden = self._forward(input_ids, positions, meta)
        step_timing.lap("forward")
        if hidden is None:  # a pipeline stage before the last: its share of the step is done
            return InFlightStep([], [], ready=StepReady(self.device))
        slots = batch.sample_slots
        step = InFlightStep(
            [s.request_id for s in slots], [s.sampling_params.logprobs for s in slots], drafts=batch.drafts
        )
        if slots:
            logits = self.model.compute_logits(self._sampled_rows(hidden, batch))
            if step_input.grammar_bitmasks:
                self._apply_grammars(logits, slots, step_input.grammar_bitmasks)
            vocab = logits.shape[-1]
            meta = self.persistent.sampling_metadata(batch, vocab, self.device)
            meta = meta or build_sampling_metadata(slots, vocab, self.device)
            step.sampled = self.sampler(logits, meta)
            step.host = [start_host_copy(t) for t in step.sampled.host_tensors()]
        for request_id, vector in pool_step(hidden, batch.pooling_spans, getattr(self.model, "classify", None)).items():
            step.pooled_host[request_id] = start_host_copy(vector)
        for span in batch.prompt_logprob_spans:
            request = batch.requests[span.row]
            tensors = prompt_logprobs(self.model, request, hidden, span)
            step.prompt_host[request.request_id] = [start_host_copy(t) for t in tensors]
        step.ready = StepReady(self.device)
        step_timing.lap("sampling")
        return step

    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        """Wait for a launched step's sampled tokens (not for steps queued after it) and return them."""
        step.ready.wait()
        out = ModelRunnerOutput()
        if step.request_ids:
            collect_samples(step, out)
            if self.draft is not None:
                self.draft.propose(self.requests, step, out)
        collect_pooled(step, out)
        for request_id, (ids, lps, ranks) in step.prompt_host.items():
            out.prompt_logprobs[request_id] = list(zip(ids.tolist(), lps.tolist(), ranks.tolist()))
        return out

    def _apply_grammars(self, logits: torch.Tensor, slots: list, bitmasks: dict) -> None:
        """Structured output: forbid, for each guided row, the tokens its grammar does not allow next
        (a request verifying drafts sends one mask per slot, in slot order)."""
        rows = [i for i, s in enumerate(slots) if s.request_id in bitmasks]
        guided = dict.fromkeys(slots[i].request_id for i in rows)  # each once, in slot order
        words = b"".join(bitmasks[rid] for rid in guided)
        bitmask = torch.frombuffer(bytearray(words), dtype=torch.int32).view(len(rows), -1)
        apply_token_bitmask(logits, to_device(rows, torch.long, self.device), move(bitmask, self.device))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, **embeds):
        """This rank's part of the forward: the final hidden states on the last pipeline stage, None
        on the others (which hand their (hidden, residual) to the next stage). `inputs_embeds`: the
        input embeddings with images placed, instead of the ids' (a vision-language model's prompt)."""
        num_tokens = input_ids.shape[0]
        if not embeds and self.decode_stack is not None and self.decode_stack.takes(meta, num_tokens):
            return self.decode_stack.forward(input_ids, positions, meta)
        with batch_invariant.step_rows(num_tokens, meta.num_decodes):
            return self._forward_layers(input_ids, positions, meta, **embeds)

    def _forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, **embeds):
        intermediate = None
        if not self.rank.is_first_stage:
            shape = (input_ids.shape[0], self.config.model_config.hf_text_config.hidden_size)
            intermediate = pp_recv([shape, shape], self.config.model_config.dtype, self.device)
        out = self.model(input_ids, positions, meta, intermediate, **embeds)
        if self.rank.is_last_stage:
            return out
        pp_send(list(out))
        return None

    def _positions(self, batch: InputBatch) -> torch.Tensor:
        """The rope positions of the step's tokens: their indices, or a multimodal rope's ([3, T] or [T])."""
        rope = step_positions(batch) if self.uses_mrope else None
        if rope is None:
            return to_device(batch.positions, torch.long, self.device)
        return torch.from_numpy(np.ascontiguousarray(rope)).to(self.device)

    def _sampled_rows(self, hidden: torch.Tensor, batch: InputBatch) -> torch.Tensor:
        """The hidden states of the tokens that sample. Indexing with a host list would copy it to
        the device from pageable memory, which waits for the whole queue (the overlapped step too)."""
        if len(batch.logits_indices) == hidden.shape[0]:  # every token samples: a decode-only step
            return hidden
        return hidden.index_select(0, to_device(batch.logits_indices, torch.long, self.device))

    def _attention_metadata(self, batch: InputBatch) -> AttentionMetadata:
        return batch.attention_metadata(self.backend, self.device, self.uses_rope_lengths)

    def _input_ids(self, batch: InputBatch, previous: InFlightStep | None) -> torch.Tensor:
        input_ids = to_device(batch.input_ids, torch.long, self.device)
        if pending := _pending_tokens(batch, previous):
            rows, sources, tokens = pending
            input_ids[to_device(rows, torch.long, self.device)] = tokens[to_device(sources, torch.long, self.device)]
        return input_ids

    def _stage_for_graph(self, batch: InputBatch, previous: InFlightStep | None) -> int:
        rope = batch.rope_lengths() if self.uses_rope_lengths else None
        pending = _pending_tokens(batch, previous)
        table = batch.block_table_tensor()
        return self.graph_runner.stage(
            batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, table, rope, pending
        )

    def _replays(self, batch: InputBatch) -> bool:
        """Whether a captured CUDA graph runs this step: decodes only (no images), few enough of them."""
        return (
            self.graph_runner is not None
            and not batch.mm_spans
            and batch.num_decodes == len(batch.requests)
            and batch.num_decodes <= self.graph_runner.max_batch_size
            and max(batch.seq_lens, default=0) <= self.config.max_seq_len_to_capture
        )


def _pending_tokens(
    batch: InputBatch, previous: InFlightStep | None
) -> tuple[list[int], list[int], torch.Tensor] | None:
    """Overlap scheduling: the rows of `batch` whose input token the step before is still sampling,
    their rows in that step, and its sampled tokens (on the device); None when there are none."""
    if not batch.pending_inputs:
        return None
    assert previous is not None, "a request's last token is pending but no step is in flight"
    return (
        [i for i, _ in batch.pending_inputs],
        [previous.row_of(rid) for _, rid in batch.pending_inputs],
        previous.sampled.token_ids,
    )
